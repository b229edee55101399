"""The keeper of a Slurm node (nebula_cli.schedulers.slurm.keeper), outside Slurm: real processes,
a real unix socket file in a private directory of a home of the test's. What it starts outlives
the call; it ends when its agents have; it serves only its own user, and its callers talk only
to a keeper of their own user (another user is a real uid: nobody); SIGTERM reaches its agents
first."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import wait_for
from helpers.keeper_agent import DAEMON

from nebula_cli.agent.procs import pid_alive

PY = sys.executable


def call(name: str, *argv: str, env: dict[str, str] | None = None,
         user: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups"] if user else []
    return subprocess.run([*prefix, PY, "-m", "nebula_cli.agent.keeper", "call", name,
                           "--env-json", json.dumps(env or {}), "--", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.fixture(autouse=True)
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home directory for the keepers and callers of a test (their sockets go under it),
    in /tmp so that another user may be let through its folders."""
    where = Path(tempfile.mkdtemp(prefix="nebula-keeper-home-", dir="/tmp"))
    monkeypatch.setenv("HOME", str(where))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def serve_argv(name: str, leave: bool = True, *options: str) -> list[str]:
    return [PY, "-m", "nebula_cli.agent.keeper", "serve", name, "--idle-timeout", "30",
            *(["--exit-after-notice"] if leave else []), *options]


def serve(name: str, leave: bool = True, *options: str) -> subprocess.Popen[str]:
    """A keeper `name` (leaving after a SIGTERM, or with `leave` False waiting to be ended as
    in an allocation; `options` of `serve`), its stdout and stderr piped."""
    return subprocess.Popen(serve_argv(name, leave, *options), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def serving(name: str, leave: bool = True, *options: str) -> Iterator[subprocess.Popen[str]]:
    """A keeper `name` that said it is ready; killed at the end."""
    proc = serve(name, leave, *options)
    try:
        assert "ready" in (proc.stdout.readline() if proc.stdout else "")
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture
def keeper() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    name = "test-" + secrets.token_hex(4)
    with serving(name) as proc:
        yield name, proc


def test_started_process_outlives_the_call_and_the_keeper_ends_after_it(
        keeper: tuple[str, subprocess.Popen[str]], tmp_path) -> None:
    name, proc = keeper
    out = call(name, PY, "-c", DAEMON, "3", str(tmp_path / "t"), env={"X_FROM_CALLER": "1"})
    assert out.returncode == 0, out.stderr
    pid = json.loads(out.stdout)["agent_pid"]
    assert pid_alive(pid)  # the call returned; what it started lives on
    assert proc.poll() is None
    wait_for(lambda: proc.poll() is not None, timeout=40)  # agent ended -> keeper ends
    assert not pid_alive(pid) and proc.returncode == 0


def test_caller_env_over_the_keepers_and_exit_codes_pass_through(
        keeper: tuple[str, subprocess.Popen[str]]) -> None:
    name, _ = keeper
    out = call(name, "/bin/sh", "-c", 'echo "$X_CALLER:$HOME"; echo oops >&2; exit 7',
               env={"X_CALLER": "mine"})
    assert out.returncode == 7
    assert out.stdout.strip() == f"mine:{os.environ['HOME']}" and out.stderr.strip() == "oops"


def test_no_keeper_is_exit_3_with_the_reason() -> None:
    out = call("absent-" + secrets.token_hex(4), "true")
    assert out.returncode == 3 and "no nebula keeper" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as another user")
def test_another_user_is_not_served(keeper: tuple[str, subprocess.Popen[str]], home: Path,
                                    tmp_path: Path) -> None:
    name, _ = keeper
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    path = Path(home, ".nebula", "keepers", f"{name}@{socket.gethostname()}.sock")
    assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    out = call(name, "/bin/sh", "-c", f"touch {marker}", user="nobody")
    assert out.returncode == 3, out  # its folder is not nobody's: not even tried
    assert _raw_call_as_nobody(path, marker) == "PermissionError"  # the kernel says no
    # opened up by mistake: the kernel lets nobody in, the keeper closes without a word
    for folder in (home, home / ".nebula", path.parent):
        folder.chmod(0o711)
    path.chmod(0o666)
    assert _raw_call_as_nobody(path, marker) == "answer none: closed"
    assert not marker.exists()


def _raw_call_as_nobody(path: Path, marker: Path) -> str:
    """As nobody: connect to `path`, hand a request over; what came back (or the error)."""
    script = textwrap.dedent(f"""
        import json, socket
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        try:
            s.connect({str(path)!r})
            s.sendall(json.dumps({{"argv": ["/bin/sh", "-c", "touch {marker}"]}}).encode())
            s.shutdown(socket.SHUT_WR)
            print("answer", s.recv(100) or "none: closed")
        except (BrokenPipeError, ConnectionResetError):  # closed before it read a byte
            print("answer none: closed")
        except OSError as exc:
            print(type(exc).__name__)
    """)
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           PY, "-c", script], capture_output=True, text=True,
                          timeout=30).stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as another user")
def test_a_keeper_of_another_user_is_not_called(home: Path, tmp_path: Path) -> None:
    """Someone else's socket where the keeper's should be (as an abstract name could be bound
    first): `call` sends it nothing, not the command, not the environment."""
    name = "test-" + secrets.token_hex(4)
    open_dir = Path(tempfile.mkdtemp(prefix="nebula-squat-", dir="/tmp"))
    open_dir.chmod(0o777)
    fake = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", PY, "-c",
         textwrap.dedent(f"""
             import socket
             s = socket.socket(socket.AF_UNIX)
             s.bind({str(open_dir / "s")!r}); s.listen(); s.settimeout(20)
             print("ready", flush=True)
             conn, _ = s.accept(); conn.settimeout(5)
             got = b""
             try:
                 while chunk := conn.recv(4096):
                     got += chunk
             except OSError:
                 pass
             print("got", len(got), flush=True)
         """)], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
        keepers = home / ".nebula" / "keepers"
        keepers.mkdir(parents=True, mode=0o700)
        (open_dir / "s").rename(keepers / f"{name}@{socket.gethostname()}.sock")
        out = call(name, "/bin/sh", "-c", "echo ran", env={"SECRET": "x"})
        assert out.returncode == 3 and "ran" not in out.stdout, out
        assert "is served by uid 65534, not by this user's keeper: nothing sent" in out.stderr
        said, _ = fake.communicate(timeout=30)
        assert said.strip() == "got 0"
    finally:
        fake.kill()
        fake.wait(10)
        shutil.rmtree(open_dir, ignore_errors=True)


def test_sigterm_reaches_the_agents_first(keeper: tuple[str, subprocess.Popen[str]],
                                          tmp_path) -> None:
    name, proc = keeper
    mark = tmp_path / "term"
    out = call(name, PY, "-c", DAEMON, "60", str(mark))
    pid = json.loads(out.stdout)["agent_pid"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert mark.read_text() == "term"
    time.sleep(0.2)
    assert not pid_alive(pid)


def test_after_the_notice_it_waits_to_be_ended_unless_told_to_leave(tmp_path) -> None:
    """In an allocation the scheduler ends the job after its notice and records why (TIMEOUT,
    PREEMPTED): leaving first would make the job COMPLETED. Only outside one it leaves."""
    name = "test-" + secrets.token_hex(4)
    with serving(name, leave=False) as proc:
        assert proc.stdout is not None
        mark = tmp_path / "term"
        out = call(name, PY, "-c", DAEMON, "60", str(mark))
        pid = json.loads(out.stdout)["agent_pid"]
        proc.send_signal(signal.SIGTERM)
        said = proc.stdout.readline()
        assert "agents stopped on the scheduler's notice; waiting for it to end the job" in said
        assert mark.read_text() == "term" and not pid_alive(pid)
        time.sleep(1.0)
        assert proc.poll() is None  # still there: the scheduler ends it


def test_after_the_notice_it_leaves_once_the_batch_scripts_trap_says_the_job_ends(
        tmp_path: Path) -> None:
    """`nebula stop` (scancel), the time limit, preemption: Slurm signals the batch shell, whose
    trap writes the end file; the keeper leaves at once (the job's state is set by then) rather
    than be killed KillWait seconds later (COMPLETING until then)."""
    name, ended = "test-" + secrets.token_hex(4), tmp_path / "12.ended"
    with serving(name, False, "--end-file", str(ended)) as proc:
        assert proc.stdout is not None
        mark = tmp_path / "term"
        pid = json.loads(call(name, PY, "-c", DAEMON, "60", str(mark)).stdout)["agent_pid"]
        proc.send_signal(signal.SIGTERM)
        assert "waiting for it to end the job" in proc.stdout.readline()
        assert mark.read_text() == "term" and not pid_alive(pid)
        time.sleep(1.0)
        assert proc.poll() is None  # the notice alone: it waits
        ended.touch()
        assert proc.wait(timeout=30) == 0
        assert f"the job is being ended ({ended}): leaving" in proc.stdout.readline()


def test_after_the_notice_its_wait_is_bounded(tmp_path: Path) -> None:
    name = "test-" + secrets.token_hex(4)
    with serving(name, False, "--notice-wait", "1", "--end-file",
                 str(tmp_path / "never")) as proc:
        assert proc.stdout is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        said = proc.stdout.read()
        assert "the job did not end within 1 s of the notice: leaving" in said, said


PARENT = """
import subprocess, sys
keeper = subprocess.Popen(sys.argv[1:])
print(keeper.pid, flush=True)
keeper.wait()
"""


@pytest.mark.parametrize("notice", [False, True], ids=["serving", "after the notice"])
def test_a_keeper_whose_parent_is_gone_stops_its_agents_and_leaves(tmp_path: Path,
                                                                    notice: bool) -> None:
    """Its step's slurmstepd gone (Slurm's daemons stopped, a node's Slurm restarted), so is
    its allocation: the keeper used to serve on (or, after the notice, sleep forever) with its
    agents, outliving the allocation, and hold its socket file: the next job of the same id
    on that node (a Slurm whose job ids started again) found it taken."""
    name, mark = "test-" + secrets.token_hex(4), tmp_path / "term"
    parent = subprocess.Popen([PY, "-c", PARENT, *serve_argv(name, False)],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    keeper = int(parent.stdout.readline())
    try:
        assert "ready" in parent.stdout.readline()
        pid = json.loads(call(name, PY, "-c", DAEMON, "60", str(mark)).stdout)["agent_pid"]
        if notice:  # its agents stopped, it waits for the scheduler to end the job
            os.kill(keeper, signal.SIGTERM)
            assert "waiting for it to end the job" in parent.stdout.readline()
        parent.kill()
        parent.wait(timeout=10)
        wait_for(lambda: not pid_alive(keeper), timeout=30)
        said = parent.stdout.read()  # what the keeper said until it left
        assert not pid_alive(pid) and mark.read_text() == "term"
        assert ("is gone" in said and "done" in said), said
        assert call(name, "true").returncode == 3  # its socket file went with it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)


def test_a_second_keeper_of_the_same_name_is_refused_and_the_first_serves_on() -> None:
    """Two Slurm clusters whose nodes share a home may run a job of the same id on nodes of the
    same name (the test beds did: job 6 on c1 in two beds): the second keeper used to remove
    the first's socket file ("no nebula keeper answers", the first's launch failed)."""
    name = "test-" + secrets.token_hex(4)
    with serving(name) as first:
        second = serve(name)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 1 and "another keeper serves" in err, err
        assert f"(pid {first.pid}: one of an earlier job of the same id" in err, err
        assert call(name, "true").returncode == 0


def test_a_keeper_leaves_a_socket_file_that_replaced_its_own(home: Path) -> None:
    """Its file removed (by hand, or taken for a dead keeper's) and a new keeper serving the
    same name: the old one ending does not remove the new one's file."""
    name = "test-" + secrets.token_hex(4)
    with serving(name) as old:
        next((home / ".nebula" / "keepers").glob(f"{name}@*.sock")).unlink()
        with serving(name):
            old.send_signal(signal.SIGTERM)
            assert old.wait(timeout=20) == 0
            assert call(name, "true").returncode == 0
