"""The host agent: supervises one role's processes (a worker's ranks, or a relay) on one host.

Started detached on every host, it runs its processes in their own process group, records
status atomically in `<dir>/status.json`, restarts them within limits, and is what `stop` and
`status` talk to. Standard library only: it runs on hosts before anything else is known to work.

    python -m nebula_cli.agent start  DIR          # daemonize and supervise DIR/agent.json
    python -m nebula_cli.agent status DIR [DIR..]  # JSON list of reconciled statuses
    python -m nebula_cli.agent stop   DIR [DIR..] [--grace S] [--force] [--leave]
    python -m nebula_cli.agent revive DIR [DIR..]  # a dead (LOST) agent replaced; statuses

An agent that died (SIGKILL, the OOM killer, a host reboot) is seen by `status` as LOST (its
pid is gone or another process's), saying whether its processes still run. `revive` starts a
new agent that ends what the old one left and restarts it as a failed rank is restarted
(`max_restarts`), or records FAILED with what to do. The control plane calls it when it sees a
LOST agent (`nebula status`, the live view); until someone looks, the processes run on
unsupervised (a crash of theirs is not restarted).

`agent.json` is the agent's part of the job plan: `nebula_cli.config.parts.AgentConfig`, loaded
strictly (unknown or missing keys refused).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nebula_cli.agent.leftovers import (
    SharedMemoryTaken,
    check_shm_buffers,
    clear_world,
    remove_stale_locks,
)
from nebula_cli.agent.logpump import drain, start_pump
from nebula_cli.agent.procs import pid_alive
from nebula_cli.agent.tunnel import revoke_dir
from nebula_cli.config.parts import (
    ABORT_EXIT,
    ENDED_ENV,
    LEAVE_SIGNAL,
    WORLD_SECRET_ENV,
    AgentConfig,
    helper_env,
)
from nebula_cli.config.plan_model import RELAY
from nebula_cli.config.rotation import ROTATION_ENV, append, rotate
from nebula_cli.config.staging import AGENT_DIR_ENV as ENV_MARK  # also names staging's record
from nebula_cli.errors import NebulaError

ACTIVE = ("STARTING", "RUNNING", "RESTARTING", "STOPPING")
POLL_S = 0.2
LAST_OUTPUT_BYTES = 8192
LAST_OUTPUT_CHARS = 300
PUMP_DRAIN_S = 2.0
"""Longest wait for a process's log pump to write what it ended with (it may be held open by
a child the process left behind)."""
OWN_LOG_CHECK_S = 10.0
"""How often the agent checks the size of its own log (agent.log)."""
TELLER_MARK = "NEBULA_AGENT_TELLER"
"""Marks the helper that tells a cluster's other hosts that a rank failed (agent dir)."""


# -- small helpers ---------------------------------------------------------------------------
def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (write a temp file, then rename over)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_agent_of(pid: int | None, agent_dir: Path) -> bool:
    """Whether pid is (still) the agent of agent_dir, not a recycled pid."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc: trust the pid
    return str(agent_dir).encode() in cmdline


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def group_alive(pgid: int | None) -> bool:
    """Whether a process group still has a live member (zombies left to init do not count)."""
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid)) if Path("/proc/self/stat").exists() else True


def signal_group(pgid: int | None, sig: int) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def marked_pids(agent_dir: Path, name: str = ENV_MARK) -> list[int]:
    """Processes whose environment carries this agent's mark (escaped groups included)."""
    mark = f"{name}={agent_dir}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == me:
            continue
        try:
            if mark in entry.joinpath("environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def sweep(agent_dir: Path, name: str = ENV_MARK) -> list[int]:
    """SIGKILL every process still carrying this agent's mark (``name``); the pids killed."""
    killed = []
    for pid in marked_pids(agent_dir, name):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


ENDED_DIR = "ended"
"""In the agent's directory: the files its ranks' hooks create once their script ended."""
ABORTED = (128 + signal.SIGABRT, -signal.SIGABRT)
"""A rank's exit status when it aborted: through its shell, or itself."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


# -- the supervisor --------------------------------------------------------------------------
class Supervisor:
    """Runs the processes of agent.json in one process group and keeps status.json true."""

    def __init__(self, agent_dir: Path, lost: dict[str, Any] | None = None) -> None:
        """`lost`: the reconciled status of this directory's earlier agent, which died while
        its processes ran (`revive`): this agent ends what is left of them and restarts them
        the way a failed rank is restarted."""
        self.dir = agent_dir
        self.lost = lost
        self.config = AgentConfig.load(agent_dir / "agent.json")
        self.status_path = agent_dir / "status.json"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[subprocess.Popen[bytes]] = []  # each process's log writer
        self.own_log_checked = time.monotonic()
        self.tellers: list[subprocess.Popen[bytes]] = []
        self.ended_said: set[str] = set()  # ranks whose abort after their end was told
        self.pgid: int | None = None
        self.stop_requested = False
        self.status: dict[str, Any] = {
            "job_id": self.config.job_id,
            "cluster": self.config.cluster,
            "host": self.config.host,
            "role": self.config.role,
            "state": "STARTING",
            "agent_pid": os.getpid(),
            "pid": None,
            "pgid": None,
            "pids": [],
            "started": time.time(),
            "ended": None,
            "exit_code": None,
            "exit_codes": {},
            "restarts": int(lost.get("restarts") or 0) if lost else 0,
            "reason": None,
        }
        if lost:
            self.pgid = lost.get("pgid")
            self.status.update(state="RESTARTING", pgid=self.pgid, reason=lost_reason(lost))

    def save(self, **changes: Any) -> None:
        self.status.update(changes)
        self.status["updated"] = time.time()
        write_json(self.status_path, self.status)

    def event(self, kind: str, message: str) -> None:
        line = json.dumps({"ts": time.time(), "kind": kind, "message": message})
        append(self.dir / "events.jsonl", (line + "\n").encode(), self.config.rotation)

    def on_term(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def spawn(self) -> None:
        self.procs = []
        self.pumps = []
        self.pgid = None
        cwd = self.config.cwd or None
        self.clear_leftovers()
        self.ended_said = set()
        shutil.rmtree(self.dir / ENDED_DIR, ignore_errors=True)  # of the last start's ranks
        (self.dir / ENDED_DIR).mkdir()
        check_shm_buffers(self.rank_env())  # never a world through another user's buffers
        for lock in remove_stale_locks(self.rank_env()):
            self.event("stale-lock", f"removed {lock}: a build killed before it ended "
                       "left it, and every process needing that op would wait on it")
        for spec in self.config.processes:
            log_path = self.dir / spec.log
            log_path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))  # there
            # from the start, whether or not the process writes (its pump appends to it)
            env = {**os.environ, **spec.env, ENV_MARK: str(self.dir),
                   ROTATION_ENV: self.config.rotation.to_env(), **self.secret_env(),
                   ENDED_ENV: str(self.ended_file(spec.name))}
            prepend = env.pop("NEBULA_PATH_PREPEND", None)
            if prepend:  # the cluster's python first, whatever PATH the host gave us
                env["PATH"] = prepend + os.pathsep + env.get("PATH", os.defpath)
            read_end, write_end = os.pipe()
            try:
                self.pumps.append(start_pump(read_end, log_path, self.dir,
                                             self.config.rotation))
                # one new process group (in the agent's session) for all of them
                kwargs: dict[str, Any] = {"process_group": self.pgid or 0}
                proc = subprocess.Popen(
                    spec.argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                    stdout=write_end, stderr=subprocess.STDOUT, **kwargs,
                )
            finally:
                os.close(read_end)
                os.close(write_end)
            if self.pgid is None:
                self.pgid = proc.pid
            self.procs.append(proc)
        self.save(state="RUNNING", pid=self.procs[0].pid, pgid=self.pgid,
                  pids=[p.pid for p in self.procs], exit_code=None, exit_codes={})
        self.event("started", f"{len(self.procs)} process(es), pgid {self.pgid}")

    def start(self) -> bool:
        """`spawn`; False (FAILED, said why) when the processes cannot be started."""
        try:
            self.spawn()
        except (OSError, SharedMemoryTaken) as exc:
            self.save(state="FAILED", reason=f"cannot start: {exc}", ended=time.time(),
                      exit_code=127)
            return False
        return True

    def rotate_own_log(self) -> None:
        """agent.log (the agent's stdout and stderr) rotated like the others, now and then."""
        now = time.monotonic()
        if now - self.own_log_checked < OWN_LOG_CHECK_S:
            return
        self.own_log_checked = now
        path = self.dir / "agent.log"
        try:
            out = os.fstat(1)
            if out.st_size <= self.config.rotation.max_bytes or out.st_ino != path.stat().st_ino:
                return  # small yet, or not writing to agent.log (run in the foreground)
            rotate(path, self.config.rotation.keep)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def last_output(self, rank: str) -> str:
        """': <the rank's last log line>' (bounded), or '' when it printed nothing."""
        spec = next((p for p in self.config.processes if p.name == rank), None)
        if spec is None:
            return ""
        at = [p.name for p in self.config.processes].index(rank)
        drain(self.pumps[at:at + 1], PUMP_DRAIN_S)
        try:
            with open(self.dir / spec.log, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - LAST_OUTPUT_BYTES))
                lines = [x.strip() for x in fh.read().decode(errors="replace").splitlines()]
        except OSError:
            return ""
        last = next((x for x in reversed(lines) if x), "")
        return f": {last[:LAST_OUTPUT_CHARS]}" if last else ""

    def rank_env(self) -> dict[str, str]:
        """The environment the ranks run with (all ranks of a host share the keys read)."""
        first = self.config.processes[0].env if self.config.processes else {}
        return {**os.environ, **first, **self.secret_env()}

    def secret_env(self) -> dict[str, str]:
        """The world secret for the ranks and the world teller (in their environment only)."""
        secret = self.config.world_secret
        return {WORLD_SECRET_ENV: secret} if secret else {}

    def tell_world(self, reason: str) -> None:
        """A worker rank failed: tell the ranks of the cluster's other hosts to leave the world
        at once (`nebula_cli.runtime.worldwatch`), so that none waits for this one. The helper
        runs on its own (it may have to wait for a slow rank 0 to serve the world's store, at
        most worldwatch.TELL_WITHIN) and carries a mark of its own: `stop` ends it with the
        rest, restarting the ranks does not."""
        env = self.rank_env()
        if (self.config.role != "worker" or int(env.get("NEBULA_NUM_NODES") or 1) < 2
                or env.get("NEBULA_NODE_RANK", "0") == "0"):
            return  # no other host; or this host's rank 0 served the world's store, and the
            # other hosts' ranks lose their connections to it when this host's ranks end
        env = helper_env(env)  # no runtime hook, and never a rank's records (it is no rank)
        env.pop("RANK", None)
        env[TELLER_MARK] = str(self.dir)
        where = f"host {self.config.host} of cluster {self.config.cluster}"
        try:
            self.tellers.append(subprocess.Popen(
                [sys.executable, "-m", "nebula_cli.runtime.worldwatch", "abort",
                 f"{time.time():.3f}", f"{where}: {reason}"],
                cwd=self.config.cwd or None, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        except OSError as exc:
            self.event("told-world", f"cannot tell the cluster's other hosts: {exc}")

    def reap_tellers(self) -> None:
        for teller in [t for t in self.tellers if t.poll() is not None]:
            self.tellers.remove(teller)
            self.event("told-world", "the cluster's other hosts were told to leave the world"
                       if teller.returncode == 0 else "the world's store was not reached (its "
                       "rank 0 is gone: the other hosts' ranks see that themselves)")

    def clear_leftovers(self) -> None:
        """/dev/shm: DeepSpeed's buffers and checkpoint staging, once none of the world is left."""
        if not group_alive(self.pgid):
            clear_world(self.rank_env(), self.dir)

    def end_group(self, grace: float) -> None:
        """SIGTERM the group, wait up to `grace` for all of it to end (not only the shells the
        agent started: `sh -c` dies at once while the python under it still winds down), then
        SIGKILL it and sweep stragglers."""
        signal_group(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (
                any(p.poll() is None for p in self.procs) or group_alive(self.pgid)):
            time.sleep(POLL_S)
        signal_group(self.pgid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        drain(self.pumps, PUMP_DRAIN_S)
        sweep(self.dir)
        self.clear_leftovers()

    def codes(self) -> dict[str, int | None]:
        """Each rank's exit status (None: running); 0 for a rank that aborted after it had
        ended (:meth:`ended_well`)."""
        ranks = [p.name for p in self.config.processes]
        got = {rank: proc.poll() for rank, proc in zip(ranks, self.procs, strict=False)}
        return {rank: 0 if self.ended_well(rank, code) else code for rank, code in got.items()}

    def ended_file(self, rank: str) -> Path:
        """Where rank ``rank``'s hook says that its script ended (config.parts.ENDED_ENV)."""
        at = [p.name for p in self.config.processes].index(rank)
        return self.dir / ENDED_DIR / f"process-{at}"

    def ended_well(self, rank: str, code: int | None) -> bool:
        """Whether ``rank`` aborted (SIGABRT) only after its script had ended: its exit handlers
        all ran and said so. Its work is done; restarted, it would wait for a world whose other
        ranks may have ended (said once in the events)."""
        if code not in ABORTED or not self.ended_file(rank).exists():
            return False
        if rank not in self.ended_said:
            self.ended_said.add(rank)
            self.event("ended", f"rank {rank} {describe_exit(code)} after its script had ended "
                       "(every exit handler ran): the interpreter's finalization aborted; its "
                       "work is done, it is not restarted")
        return True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, self.on_term)
        max_restarts = self.config.max_restarts
        backoff = self.config.restart_backoff
        if self.lost and not self.take_over(max_restarts, backoff):
            return 1
        if not self.stop_requested and not self.start():
            return 1
        while True:
            if self.stop_requested:
                return self.stop()
            codes = self.codes()
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed:
                rank, code = next(iter(failed.items()))
                reason = f"rank {rank} {describe_exit(code)}{self.last_output(rank)}"
                self.event("failed", reason)
                if code != ABORT_EXIT:  # (a rank told to leave: its world knows)
                    self.tell_world(reason)
                self.end_group(self.config.grace)
                codes = self.codes()
                if self.status["restarts"] < max_restarts and not self.stop_requested:
                    self.save(state="RESTARTING", reason=reason, exit_codes=codes,
                              restarts=self.status["restarts"] + 1)
                    self.event("restarting", f"restart {self.status['restarts']} in {backoff:g} s")
                    if self._sleep(backoff):
                        return self.stop()
                    if not self.start():
                        return 1
                    continue
                self.save(state="FAILED", reason=reason, exit_code=code, exit_codes=codes,
                          ended=time.time())
                return 1
            if all(c == 0 for c in codes.values()):
                drain(self.pumps, PUMP_DRAIN_S)
                self.clear_leftovers()
                self.save(state="SUCCEEDED", exit_code=0, exit_codes=codes, ended=time.time())
                self.event("succeeded", "all processes exited 0")
                return 0
            self.reap_tellers()
            self.rotate_own_log()
            time.sleep(POLL_S)

    def take_over(self, max_restarts: int, backoff: float) -> bool:
        """The processes a dead agent left: told, ended, and restarted when restarts are left
        (then True); FAILED with what to do when none are."""
        reason = lost_reason(self.lost or {})
        self.event("agent-lost", reason)
        self.tell_world(reason)
        if self.pgid and not set(group_members(self.pgid)) & set(marked_pids(self.dir)):
            self.pgid = None  # the old group is gone and its id may be another's now
        self.end_group(self.config.grace)
        restarts = self.status["restarts"]
        if restarts >= max_restarts:
            self.save(state="FAILED", ended=time.time(), exit_code=None, reason=(
                f"{reason}; no restarts left (max_restarts {max_restarts}): `nebula resume "
                f"{self.config.job_id}` restarts the job from its newest checkpoints"))
            self.event("failed", self.status["reason"])
            return False
        self.save(state="RESTARTING", restarts=restarts + 1, reason=reason)
        self.event("restarting", f"restart {restarts + 1} in {backoff:g} s (its agent died)")
        self._sleep(backoff)
        return True

    def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on a stop request (returns True then)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_requested:
                return True
            time.sleep(POLL_S)
        return self.stop_requested

    def stop(self) -> int:
        request = read_json(self.dir / "stop.json") or {}
        grace = 0.0 if request.get("force") else float(
            request.get("grace", self.config.grace))
        self.save(state="STOPPING")
        if request.get("leave") and self.config.role == RELAY:
            signal_group(self.pgid, LEAVE_SIGNAL)  # its peers are told not to wait for it
        self.end_group(grace)
        self.save(state="STOPPED", exit_codes=self.codes(), ended=time.time(),
                  reason="stopped on request")
        self.event("stopped", f"stopped (grace {grace:g} s)")
        return 0


# -- commands ---------------------------------------------------------------------------------
def daemonize(agent_dir: Path) -> int:
    """Fork a supervisor detached from this session; print its pid once it has started."""
    pid = start_detached(agent_dir)
    if pid is None:
        print(json.dumps({"error": "agent did not start; see agent.log"}))
        return 1
    print(json.dumps({"agent_pid": pid}))
    return 0


def start_detached(agent_dir: Path, lost: dict[str, Any] | None = None) -> int | None:
    """Fork a supervisor detached from this session; its pid once it has started (None: it
    did not start, agent.log says why)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:  # the caller: wait for the daemon to report its pid
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            line = pipe.readline().strip()
        os.waitpid(pid, 0)
        return int(line) if line else None
    os.close(read_fd)
    os.setsid()
    if os.fork():
        os._exit(0)
    log = os.open(agent_dir / "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    try:
        supervisor = Supervisor(agent_dir, lost)
        supervisor.save()
    except Exception as exc:  # noqa: BLE001 - report anything that stops the start
        print(f"agent: cannot start: {exc}", flush=True)
        os.close(write_fd)
        os._exit(1)
    os.write(write_fd, f"{os.getpid()}\n".encode())
    os.close(write_fd)
    os._exit(supervisor.run())


def reconciled_status(agent_dir: Path) -> dict[str, Any]:
    """status.json, corrected when the agent vanished without recording an end."""
    status = read_json(agent_dir / "status.json")
    if status is None:
        return {"dir": str(agent_dir), "state": "PENDING", "reason": "agent not started"}
    status["dir"] = str(agent_dir)
    if status.get("state") in ACTIVE and not is_agent_of(status.get("agent_pid"), agent_dir):
        # read again: the agent may have recorded its end and exited since the first read
        status = {**(read_json(agent_dir / "status.json") or status), "dir": str(agent_dir)}
    if status.get("state") in ACTIVE and not is_agent_of(status.get("agent_pid"), agent_dir):
        status["state"] = "LOST"
        status["agent_lost"] = True
        status["group_alive"] = group_alive(status.get("pgid"))
        status["reason"] = lost_reason(status)
        return status
    status["group_alive"] = group_alive(status.get("pgid"))
    return status


def lost_reason(status: dict[str, Any]) -> str:
    """Why an agent is LOST, and whether what it ran still runs (unsupervised)."""
    left = ("its processes still run, unsupervised" if status.get("group_alive")
            else "its processes are gone")
    return f"its agent (pid {status.get('agent_pid')}) died without recording an end; {left}"


def revive(agent_dir: Path) -> dict[str, Any]:
    """A LOST agent (it died; a host reboot, the OOM killer, a stray kill) replaced: a new one
    ends what the old one left, then restarts its processes if restarts are left
    (`Supervisor.take_over`). Any other agent's status is returned as it is."""
    status = reconciled_status(agent_dir)
    if status.get("state") != "LOST" or not status.get("agent_lost"):
        return status
    start_detached(agent_dir, status)
    return reconciled_status(agent_dir)


def _configured_grace(agent_dir: Path) -> float:
    try:
        return AgentConfig.load(agent_dir / "agent.json").grace
    except NebulaError:
        return 0.0  # no usable config: nothing the agent would wait for either


def stop_all(agent_dirs: list[Path], grace: float | None, force: bool,
             leave: bool = False) -> list[dict[str, Any]]:
    """Ask every agent to stop its group at once; make sure nothing of them is left either way.
    `grace` None: each agent's own (its agent.json's, from the spec). `leave`: the cluster
    leaves the job for good (a relay says so to its peers: `config.parts.LEAVE_SIGNAL`)."""
    before = {d: read_json(d / "status.json") or {} for d in agent_dirs}
    graces = [0.0]
    for d, status in before.items():
        if not d.is_dir():
            continue  # never provisioned: only the sweep below can find anything of it
        request: dict[str, Any] = {"force": force, "leave": leave, "ts": time.time()}
        if grace is not None:
            request["grace"] = grace
        graces.append(grace if grace is not None else _configured_grace(d))
        write_json(d / "stop.json", request)
        if is_agent_of(status.get("agent_pid"), d):
            os.kill(status["agent_pid"], signal.SIGTERM)
    deadline = time.monotonic() + (0 if force else max(graces)) + 15
    while time.monotonic() < deadline and any(
        is_agent_of(s.get("agent_pid"), d) for d, s in before.items()
    ):
        time.sleep(POLL_S)
    results = []
    for d, status in before.items():
        if is_agent_of(status.get("agent_pid"), d):
            os.kill(status["agent_pid"], signal.SIGKILL)
        signal_group(status.get("pgid"), signal.SIGKILL)
        killed = sweep(d) + sweep(d, TELLER_MARK)
        with contextlib.suppress(NebulaError, OSError):  # keys a killed relay left granted
            revoke_dir(d)
        with contextlib.suppress(NebulaError, OSError, ValueError):  # agent killed first
            config = AgentConfig.load(d / "agent.json")
            if config.processes and not group_alive(status.get("pgid")):
                clear_world({**os.environ, **config.processes[0].env}, d)
        after = reconciled_status(d)
        if d.is_dir() and after.get("state") in (*ACTIVE, "LOST"):
            after.update(state="STOPPED", ended=after.get("ended") or time.time(),
                         reason="stopped on request")
            after.pop("group_alive", None)
            write_json(d / "status.json", {k: v for k, v in after.items() if k != "dir"})
        after["was"] = status.get("state", "PENDING")
        after["swept"] = killed
        results.append(after)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nebula-agent", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a detached supervisor for DIR")
    start.add_argument("dir", type=Path)
    start.add_argument("--foreground", action="store_true", help="supervise in this process")
    status = sub.add_parser("status", help="print the reconciled status of each DIR as JSON")
    status.add_argument("dirs", type=Path, nargs="+")
    revive_cmd = sub.add_parser("revive", help="replace each DIR's agent if it died (LOST); "
                                "print each reconciled status as JSON")
    revive_cmd.add_argument("dirs", type=Path, nargs="+")
    stop = sub.add_parser("stop", help="stop each DIR's processes; print what was stopped")
    stop.add_argument("dirs", type=Path, nargs="+")
    stop.add_argument("--grace", type=float, default=None,
                      help="seconds between SIGTERM and SIGKILL (default: each agent's own)")
    stop.add_argument("--force", action="store_true")
    stop.add_argument("--leave", action="store_true",
                      help="the cluster leaves the job for good: a relay tells its peers first")
    args = parser.parse_args(argv)

    if args.command == "start":
        agent_dir = args.dir.resolve()
        if not (agent_dir / "agent.json").is_file():
            print(json.dumps({"error": f"{agent_dir}/agent.json not found"}))
            return 2
        try:  # a bad agent.json is refused here, where the caller sees why
            AgentConfig.load(agent_dir / "agent.json")
        except NebulaError as exc:
            print(json.dumps({"error": str(exc)}))
            return 2
        if args.foreground:
            return Supervisor(agent_dir).run()
        return daemonize(agent_dir)
    if args.command == "status":
        from nebula_cli.agent.summary import attach  # newest metrics, bounded reads

        print(json.dumps([attach(reconciled_status(d.resolve()), d.resolve())
                          for d in args.dirs]))
        return 0
    if args.command == "revive":
        print(json.dumps([revive(d.resolve()) for d in args.dirs]))
        return 0
    print(json.dumps(stop_all([d.resolve() for d in args.dirs], args.grace, args.force,
                                args.leave)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
