"""The keeper: one process per node of a Slurm allocation, the batch job's long-lived step.

On a Slurm node every process must belong to a job step, and a step's processes end when the
step does (proctrack/cgroup kills what is left). A host agent started by a short ``srun
--overlap`` command would die with that command's step. So the batch script starts one keeper
per node (``srun --ntasks-per-node=1 ... keeper serve NAME``) and commands that must outlive
their own step (the agent's `start`, which daemonizes) are handed to the keeper of their node
(``keeper call NAME ...`` run by ``srun --overlap`` on that node): the keeper runs them as its
children, inside its step, with its step's environment (SLURM_*, the GPUs Slurm gave it) under
the caller's.

The keeper listens on a Unix socket file, ``~/.nebula/keepers/<name>@<node>.sock`` (0600, in a
0700 directory of the user's: another user's process cannot reach it, let alone bind it
first), and serves only processes of its own user (SO_PEERCRED); `call` checks the same of the
keeper before it sends a byte (an abstract socket, as before, had no permissions: whoever bound
its name first received the callers' argv and environment). The node's name in the file's
name keeps the keepers of one job apart where the home directory is shared. A keeper does not
take over a file a live keeper serves (two Slurm clusters sharing a home, a job id and a node
name), and removes only its own file when it ends.

It ends, releasing the node, `LINGER` seconds after every
agent it started has ended, when nothing was started for `IDLE_TIMEOUT` seconds after it came
up, when its step's parent (the node's slurmstepd) is gone (the allocation ended without it:
its agents are stopped first), or on SIGTERM (Slurm's notice before a time limit or
preemption), which it passes to its agents first so that their workers stop gracefully. After
the notice it waits for the scheduler to end the job, so that the job's state says why
(TIMEOUT, PREEMPTED, CANCELLED): it leaves once the batch script's trap says the job is being
ended (``--end-file``: Slurm signals the batch shell only when it ends the job, by `scancel`,
`nebula stop`, the time limit or preemption, never with the notice), once its step's parent is
gone, or `NOTICE_WAIT` seconds after the notice at the latest; at once when started with
``--exit-after-notice`` (outside any scheduler: the tests).

Standard library only: it runs before anything else of the job is checked on the node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from nebula_cli.agent.procs import pid_alive
from nebula_cli.agent.unix_socket import bindable, listen, peer_uid, private_dir, unlink_own

IDLE_TIMEOUT = 900.0
"""Seconds a keeper waits for its first agent before it gives the node back."""
LINGER = 15.0
"""Seconds a keeper stays after its last agent ended: the command that ended it (a `stop` run
as an srun step) returns before the allocation, and its steps, end."""
TERM_GRACE = 110.0
"""Seconds the keeper gives its agents after SIGTERM (Slurm's notice is 120 s by default)."""
NOTICE_WAIT = 600.0
"""Seconds at most a keeper waits, its agents stopped, for the scheduler to end the job after
its notice, unless told (`--notice-wait`: launchers/slurm.sbatch passes the notice's lead plus a
margin): the default notice's lead, 120 s, plus Slurm's KillWait, 30 s by default, with a wide
margin. It normally leaves long before, on the batch script's end file."""
POLL = 0.5
MAX_REQUEST = 16 << 20
CALL_TIMEOUT = 120.0


SOCKET_DIR = "~/.nebula/keepers"


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def socket_path(name: str) -> str:
    """The socket file of the keeper called `name` on this node (one per node and Slurm job)."""
    return os.path.join(os.path.expanduser(SOCKET_DIR), f"{name}@{node_name()}.sock")


def _recv_all(sock: socket.socket) -> bytes:
    chunks, size = [], 0
    while chunk := sock.recv(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REQUEST:
            raise ValueError("request too large")
    return b"".join(chunks)


class Keeper:
    """Serves `call`s on its node; watches the agents it started."""

    def __init__(self, name: str, idle_timeout: float = IDLE_TIMEOUT, *,
                 exit_after_notice: bool = False, end_file: str | None = None,
                 notice_wait: float = NOTICE_WAIT) -> None:
        self.name = name
        self.idle_timeout = idle_timeout
        self.exit_after_notice = exit_after_notice
        """After SIGTERM and its agents' end, leave (rather than wait for the scheduler to end
        the allocation, which then records why: TIMEOUT, PREEMPTED, CANCELLED)."""
        self.end_file = end_file
        """Written by the batch script's trap when Slurm ends the job (None: no such trap)."""
        self.notice_wait = notice_wait
        self.parent = os.getppid()
        """Its step's slurmstepd (in an allocation): once it is gone, so is the allocation."""
        self.agents: set[int] = set()
        self.started = self.last_alive = time.monotonic()
        self.terminated = threading.Event()
        self.lock = threading.Lock()

    def handle(self, conn: socket.socket) -> None:
        with conn:
            if peer_uid(conn) != os.getuid():
                return  # another user's process: nothing is run, nothing is said
            try:
                request = json.loads(_recv_all(conn))
                reply = self.run(request)
            except (ValueError, OSError, KeyError, TypeError) as exc:
                reply = {"exit_code": 2, "stdout": "", "stderr": f"keeper {self.name}: {exc}\n"}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode())

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        argv = [str(a) for a in request["argv"]]
        env = {**os.environ, **{str(k): str(v) for k, v in (request.get("env") or {}).items()}}
        proc = subprocess.run(argv, env=env, cwd=request.get("cwd") or None,
                              capture_output=True, timeout=float(request.get("timeout") or
                                                                 CALL_TIMEOUT),
                              stdin=subprocess.DEVNULL, check=False)
        out = proc.stdout.decode(errors="replace")
        with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
            pid = int(json.loads(out.strip().splitlines()[-1])["agent_pid"])
            with self.lock:
                self.agents.add(pid)
        return {"exit_code": proc.returncode, "stdout": out,
                "stderr": proc.stderr.decode(errors="replace")}

    def live_agents(self) -> list[int]:
        with self.lock:
            return [p for p in self.agents if pid_alive(p)]

    def done(self) -> bool:
        with self.lock:
            started_any = bool(self.agents)
        if not started_any:
            return time.monotonic() - self.started > self.idle_timeout
        if self.live_agents():
            self.last_alive = time.monotonic()
            return False
        return time.monotonic() - self.last_alive > LINGER

    def on_term(self, signum: int, frame: object) -> None:
        self.terminated.set()

    def serve(self) -> int:
        path = socket_path(self.name)
        node = node_name()
        try:
            server = listen(path, "keeper", hint="one of an earlier job of the same id on "
                            "this node, left running? end it if so")
            mine = os.stat(path).st_ino
        except OSError as exc:
            print(f"nebula keeper {self.name} on {node}: cannot listen on {path}: {exc}",
                  file=sys.stderr, flush=True)
            return 1
        try:
            return self._serve(server, path, node, mine)
        finally:
            server.close()
            unlink_own(path, mine)

    def _serve(self, server: socket.socket, path: str, node: str, mine: int) -> int:
        server.settimeout(POLL)
        signal.signal(signal.SIGTERM, self.on_term)
        print(f"nebula keeper {self.name} on {node}: ready (pid {os.getpid()})", flush=True)
        while not self.terminated.is_set() and not self.done() and not self.orphaned():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
        server.close()
        unlink_own(path, mine)
        if self.orphaned():  # its output went with that parent: its agents first
            self.stop_agents()
            self.say(node, f"its step's parent (pid {self.parent}) is gone, the allocation "
                           "with it: agents stopped, leaving")
        elif self.terminated.is_set():
            self.stop_agents()
            if not self.exit_after_notice:  # the scheduler ends the job and says why
                self.say(node, "agents stopped on the scheduler's notice; waiting for it to "
                               "end the job")
                self.say(node, self.wait_for_the_end())
        self.say(node, "done")
        return 0

    def say(self, node: str, what: str) -> None:
        """One line of the job's output (none when its reader, the step, is gone)."""
        with contextlib.suppress(OSError):
            print(f"nebula keeper {self.name} on {node}: {what}", flush=True)

    def orphaned(self) -> bool:
        """Whether the process that started it (its step's slurmstepd) is gone."""
        return os.getppid() != self.parent

    def ending(self) -> bool:
        """Whether the batch script's trap says that Slurm ends the job."""
        return self.end_file is not None and os.path.exists(self.end_file)

    def wait_for_the_end(self) -> str:
        """After the notice, until the scheduler ends the job (its state then says why:
        TIMEOUT, PREEMPTED, CANCELLED; leaving first would make it COMPLETED), bounded; why it
        stopped waiting."""
        deadline = time.monotonic() + self.notice_wait
        while time.monotonic() < deadline:
            if self.ending():
                return f"the job is being ended ({self.end_file}): leaving"
            if self.orphaned():
                return f"its step's parent (pid {self.parent}) is gone: leaving"
            time.sleep(POLL)
        return f"the job did not end within {self.notice_wait:g} s of the notice: leaving"

    def stop_agents(self) -> None:
        """SIGTERM to every live agent (each stops its workers gracefully), then wait."""
        for pid in self.live_agents():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        while self.live_agents() and time.monotonic() < deadline:
            time.sleep(POLL)


def call(name: str, argv: list[str], env: dict[str, str], cwd: str | None,
         timeout: float) -> int:
    """Hand `argv` to the keeper `name` on this node; print its output; its exit code (3 when
    no keeper answers)."""
    path = socket_path(name)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout + 10)
    try:
        private_dir(os.path.dirname(path), make=False)
        with bindable(path) as where:
            sock.connect(where)
        if (uid := peer_uid(sock)) != os.getuid():
            print(f"{path} is served by uid {uid}, not by this user's keeper: nothing sent "
                  f"(remove it; the node's other users should not reach it)", file=sys.stderr)
            return 3
        sock.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd,
                                 "timeout": timeout}).encode())
        sock.shutdown(socket.SHUT_WR)
        reply = json.loads(_recv_all(sock))
    except (OSError, ValueError) as exc:
        print(f"no nebula keeper {name} answers on {node_name()}: {exc} (is the batch job's keeper "
              "step running? see the job's slurm output)", file=sys.stderr)
        return 3
    finally:
        sock.close()
    sys.stdout.write(reply.get("stdout", ""))
    sys.stderr.write(reply.get("stderr", ""))
    return int(reply.get("exit_code", 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nebula-keeper", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="keep this node: run what is handed over")
    serve.add_argument("name")
    serve.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT)
    serve.add_argument("--exit-after-notice", action="store_true",
                       help="after SIGTERM, leave once the agents ended (outside a scheduler's "
                            "allocation); by default wait for the scheduler to end the job")
    serve.add_argument("--end-file", default=None,
                       help="after SIGTERM, leave once this file exists (the batch script's "
                            "trap writes it when Slurm ends the job)")
    serve.add_argument("--notice-wait", type=float, default=NOTICE_WAIT,
                       help="seconds at most to wait for the job's end after SIGTERM")
    hand = sub.add_parser("call", help="hand a command to this node's keeper")
    hand.add_argument("name")
    hand.add_argument("--env-json", default="{}")
    hand.add_argument("--cwd", default=None)
    hand.add_argument("--timeout", type=float, default=CALL_TIMEOUT)
    hand.add_argument("argv", nargs="+", help="the command, after --")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return Keeper(args.name, args.idle_timeout, exit_after_notice=args.exit_after_notice,
                      end_file=args.end_file, notice_wait=args.notice_wait).serve()
    return call(args.name, args.argv, json.loads(args.env_json), args.cwd, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
