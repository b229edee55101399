"""A build of a DeepSpeed op killed halfway leaves torch's FileBaton lock behind; the agent
removes it before it starts a host's processes, so the next job does not wait on it forever.
A lock some live process holds is left alone. DeepSpeed's /dev/shm buffers go with their world;
one another user (a real uid: nobody) made at a name of the world's stops the world's start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.agents import agent, make_dir, status
from helpers.jobs import wait_for

from nebula_cli.agent import leftovers
from nebula_cli.agent.supervisor import marked_pids

OTHER_UID = 65534  # nobody: another user of the node

HOLD = ("import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
        "assert FileBaton(sys.argv[1]).try_acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")
# what torch.utils.cpp_extension does before it builds or loads an op
BUILD = ("import sys\nfrom torch.utils.file_baton import FileBaton\nb = FileBaton(sys.argv[1])\n"
         "if b.try_acquire():\n    b.release()\nelse:\n    b.wait()\nprint('built')\n")


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def hold(lock: Path, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE,
                            text=True)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    old = time.time() - 2 * leftovers.MIN_AGE_S  # as if the build had run a while
    os.utime(lock, (old, old))
    return proc


def test_a_lock_left_by_a_killed_build_is_removed_and_a_held_one_kept(
        tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    ext = tmp_path / "torch-ext"
    killed, held = ext / "fused_adam" / "lock", ext / "shm_comm" / "lock"
    victim = hold(killed, holders)
    victim.send_signal(signal.SIGKILL)  # killed in the middle of its build
    victim.wait()
    hold(held, holders)
    env = {"TORCH_EXTENSIONS_DIR": str(ext), "HOME": str(tmp_path)}
    assert leftovers.stale_locks(env) == [killed]

    script = tmp_path / "build.py"
    script.write_text(BUILD)
    d = make_dir(tmp_path, f"{sys.executable} {script} {killed}")
    cfg = json.loads((d / "agent.json").read_text())
    cfg["processes"][0]["env"].update(env)
    (d / "agent.json").write_text(json.dumps(cfg))
    try:
        agent("start", str(d))
        done = wait_for(lambda: (s := status(d))["state"] in ("SUCCEEDED", "FAILED") and s,
                        timeout=60)
    finally:
        agent("stop", "--force", str(d))
    assert done["state"] == "SUCCEEDED", (d / "logs/rank0.log").read_text()
    assert (d / "logs/rank0.log").read_text().strip().endswith("built")
    events = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]
    assert [e["message"].split(":")[0] for e in events if e["kind"] == "stale-lock"] == [
        f"removed {killed}"]
    assert held.exists()  # its builder is alive: not ours to judge
    assert not marked_pids(d.resolve())


def test_a_fresh_lock_is_not_judged(tmp_path: Path) -> None:
    lock = tmp_path / "torch-ext" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # nobody holds it, but it is younger than MIN_AGE_S: a release may be going on
    env = {"TORCH_EXTENSIONS_DIR": str(lock.parent.parent), "HOME": str(tmp_path)}
    assert leftovers.lock_files(env) == [lock]
    assert leftovers.stale_locks(env) == []
    assert leftovers.stale_locks(env, now=time.time() + leftovers.MIN_AGE_S) == [lock]


def test_the_shared_memory_buffers_of_a_world_go_with_it(tmp_path: Path) -> None:
    """DeepSpeed's CPU comm op never unlinks its /dev/shm buffers; the agent does, once the
    world is gone (a restart and the end), and leaves other worlds' alone."""
    port = str(40000 + os.getpid() % 20000)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    other = leftovers.SHM / f"{leftovers.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}1_0"
    mine = f"{leftovers.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_$MY_RANK"
    first_run = tmp_path / "first"  # rank 0 fails the first run: its world is restarted
    d = make_dir(tmp_path, f'test -e /dev/shm/{mine} && echo "still there"; '
                 f'head -c 1000 /dev/zero > /dev/shm/{mine}; sleep 0.3; '
                 f'if [ "$MY_RANK" = 0 ] && [ ! -e {first_run} ]; then touch {first_run}; '
                 'exit 1; fi', slots=2, max_restarts=1)
    cfg = json.loads((d / "agent.json").read_text())
    for proc in cfg["processes"]:
        proc["env"].update(env)
    (d / "agent.json").write_text(json.dumps(cfg))
    other.write_bytes(b"x")
    try:
        agent("start", str(d))
        done = wait_for(lambda: (s := status(d))["state"] in ("SUCCEEDED", "FAILED") and s,
                        timeout=30)
        assert done["state"] == "SUCCEEDED" and done["restarts"] == 1, done
        assert leftovers.shm_buffers(env) == []
        assert "still there" not in (d / "logs/rank0.log").read_text()  # gone before restart
        assert other.exists()
    finally:
        agent("stop", "--force", str(d))
        other.unlink(missing_ok=True)
        for path in leftovers.shm_buffers(env):
            path.unlink()


@pytest.mark.parametrize("planted", ["a file", "a symlink"])
def test_a_world_is_not_started_through_another_users_buffer(tmp_path: Path,
                                                             planted: str) -> None:
    """DeepSpeed opens its /dev/shm buffers without O_EXCL: one another user made first at a
    name of the world's would carry its tensors. The agent neither removes nor uses it: the
    world is not started, its status says which file and whose, and nothing ran."""
    port = str(40000 + (os.getpid() + 7) % 20000)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    taken = leftovers.SHM / f"{leftovers.SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_1"
    ran = tmp_path / "ran"
    d = make_dir(tmp_path, f"touch {ran}", slots=2)
    cfg = json.loads((d / "agent.json").read_text())
    for proc in cfg["processes"]:
        proc["env"].update(env)
    (d / "agent.json").write_text(json.dumps(cfg))
    made = "touch" if planted == "a file" else f"ln -s {tmp_path / 'nowhere'}"
    subprocess.run(["/bin/sh", "-c", f"umask 0; {made} {taken}"], user=OTHER_UID,
                   group=OTHER_UID, check=True, cwd="/", timeout=30)  # a neighbour on the node
    try:
        agent("start", str(d))
        done = wait_for(lambda: (s := status(d))["state"] in ("SUCCEEDED", "FAILED") and s,
                        timeout=30)
        assert done["state"] == "FAILED", done
        assert f"{taken} belongs to another user (uid {OTHER_UID})" in done["reason"], done
        assert "O_EXCL" in done["reason"] and f"rm {taken}" in done["reason"]
        assert not ran.exists()  # no process of the world started
        assert os.lstat(taken).st_uid == OTHER_UID  # left as it was
    finally:
        agent("stop", "--force", str(d))
        taken.unlink(missing_ok=True)
