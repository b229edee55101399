"""The checkpoint staging directory in /dev/shm (nebula_cli.config.staging, used by
nebula_cli.runtime.checkpoint and removed by nebula_cli.agent.leftovers) on a node other users
share: another user who plants a directory or a symlink where the old, computable name pointed
gets nothing; the directory is 0700, ours, with a random name, recorded in the agent's folder;
an existing path is refused; a rank refuses a recorded directory that is not private; the ranks
of one host (two real processes in a gloo world) stage in the one their writer made; a
restarted writer and the agent remove what a killed one left, and never what is not ours.
The outer state is unpickled with weights_only=True, and DeepSpeed's files (which it unpickles
fully) only when nobody else could have written them.

REALWORLD rows: `/dev/shm`, `/tmp` and GPUs shared with other users' jobs on the same node;
several ranks per node; a user who is not root (the other user here is a real uid: nobody)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.checkpoint_standins import StandInEngine, StandInSync
from helpers.jobs import REPO, wait_for
from helpers.plan_defaults import default_checkpoint

from nebula_cli.agent import leftovers
from nebula_cli.config import staging
from nebula_cli.config.parts import SHM
from nebula_cli.runtime import checkpoint as ck
from nebula_cli.runtime import outer_files
from nebula_cli.runtime.outer import SyncError

OTHER_UID = 65534  # nobody: a real user other than the job's on every Debian machine


@pytest.fixture
def agent_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An agent's folder (0700) named to this process, as the agent names it to its ranks; what
    the test's staging left in /dev/shm is removed after."""
    path = tmp_path / "agent"
    path.mkdir(mode=0o700)
    monkeypatch.setenv(staging.AGENT_DIR_ENV, str(path))
    yield path
    leftovers.remove_checkpoint_staging(path)


@pytest.fixture
def shm_paths() -> Iterator[list[Path]]:
    """Paths a test makes in /dev/shm (as another user or not), removed after."""
    made: list[Path] = []
    yield made
    for path in made:
        subprocess.run(["rm", "-rf", "--", str(path)], check=False)


def as_other_user(script: str) -> None:
    """Run a shell script as another user (uid OTHER_UID), as a neighbour on the node would."""
    subprocess.run(["/bin/sh", "-c", script], user=OTHER_UID, group=OTHER_UID, check=True,
                   cwd="/", timeout=30)


def old_name(directory: Path) -> Path:
    """Where nebula staged before: a name any local user can compute from the checkpoint dir
    (which the agent's command line shows)."""
    return SHM / f"nebula-ckpt-{hashlib.sha256(str(directory).encode()).hexdigest()[:16]}"


def private(path: Path) -> bool:
    info = os.lstat(path)
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) == 0o700)


def test_a_directory_another_user_planted_at_the_old_name_gets_nothing(
        tmp_path: Path, agent_dir: Path, shm_paths: list[Path]) -> None:
    """The neighbour makes the computable staging directory first, world-writable, with a
    `step10` symlink into a directory of theirs: nothing of the checkpoint reaches it, the
    published checkpoint is ours alone."""
    directory = tmp_path / "ckpt"
    planted, loot = old_name(directory), Path(f"/tmp/nebula-loot-{os.getpid()}")
    shm_paths += [planted, loot]
    as_other_user(f"mkdir -m 777 {loot} {planted} && ln -s {loot} {planted}/step10")
    engine = StandInEngine()
    saver = ck.Checkpointer(engine, default_checkpoint(directory, every=10), sync=StandInSync(1))
    engine.global_steps = 10
    assert saver.save(10)
    saver.wait()
    assert list(loot.iterdir()) == []  # nothing written through the planted symlink
    assert sorted(p.name for p in planted.iterdir()) == ["step10"]  # their tree untouched
    (used,) = set(engine.saved_to)
    assert Path(used) != planted and Path(used).parent == SHM and private(Path(used))
    assert ck.complete_steps(directory) == [10]
    assert sorted(p.name for p in (directory / "step10").iterdir()) == sorted([
        ck.MARKER, outer_files.file_name(0), engine.rank_file])
    saver.close()


def test_the_staging_directory_is_private_random_and_recorded_in_the_agents_folder(
        tmp_path: Path, agent_dir: Path) -> None:
    """Made 0700 whatever the umask, named with 128 random bits (not from the checkpoint
    directory: two agents with the same settings get different ones), recorded 0600 in the
    agent's folder; published files are 0600 in 0700 directories."""
    settings = default_checkpoint(tmp_path / "ckpt", every=5)
    old_umask = os.umask(0)  # a umask that would leave everything open to everyone
    try:
        engine = StandInEngine()
        saver = ck.Checkpointer(engine, settings)
        engine.global_steps = 5
        assert saver.save(5)
        saver.wait()
    finally:
        os.umask(old_umask)
    used = staging.recorded(agent_dir)
    assert used is not None and {str(used)} == set(engine.saved_to)
    assert private(used) and staging.NAME.fullmatch(used.name)
    assert used != old_name(tmp_path / "ckpt")
    record = os.lstat(agent_dir / staging.RECORD)
    assert stat.S_IMODE(record.st_mode) == 0o600 and record.st_uid == os.getuid()
    for path in (settings.dir, f"{settings.dir}/step5"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    for path in Path(settings.dir, "step5").iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path

    other = tmp_path / "agent2"
    other.mkdir(mode=0o700)
    try:
        second = staging.create(other)
        assert second != used and staging.recorded(other) == second
    finally:
        staging.remove(other)
    saver.close()
    assert not used.exists() and not (agent_dir / staging.RECORD).exists()


@pytest.mark.parametrize("kind", ["another user's directory", "a symlink"])
def test_an_existing_path_is_refused_and_the_checkpoint_staged_on_disk(
        tmp_path: Path, agent_dir: Path, shm_paths: list[Path],
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Should the random name exist already, it is never used: the save stages on disk."""
    name = "0" * 32
    taken = SHM / f"{staging.PREFIX}{name}"
    shm_paths.append(taken)
    if kind == "a symlink":
        target = tmp_path / "ours"
        target.mkdir()
        taken.symlink_to(target)
    else:
        as_other_user(f"mkdir -m 777 {taken}")
    monkeypatch.setattr(staging.secrets, "token_hex", lambda n: name)
    with pytest.raises(FileExistsError):
        staging.create(agent_dir)
    engine = StandInEngine()
    saver = ck.Checkpointer(engine, default_checkpoint(tmp_path / "ckpt", every=3))
    engine.global_steps = 3
    assert saver.save(3)
    saver.close()
    assert engine.saved_to == [str(tmp_path / "ckpt" / ".staging")]
    assert ck.complete_steps(tmp_path / "ckpt") == [3]
    assert os.path.lexists(taken) and list(Path(taken).iterdir()) == []
    if kind != "a symlink":
        assert os.lstat(taken).st_uid == OTHER_UID
    assert staging.recorded(agent_dir) is None


@pytest.mark.parametrize("kind", ["another user's", "open to others", "a symlink"])
def test_a_rank_refuses_a_recorded_directory_that_is_not_private(
        tmp_path: Path, agent_dir: Path, shm_paths: list[Path], kind: str) -> None:
    """A rank other than the host's writer stages where the record says only after checking it
    with lstat: ours, a directory, no symlink, 0700. Otherwise it stages on disk."""
    recorded = staging.create(agent_dir)
    shm_paths.append(recorded)
    if kind == "another user's":
        os.chown(recorded, OTHER_UID, OTHER_UID)
    elif kind == "open to others":
        recorded.chmod(0o755)
    else:
        recorded.rmdir()
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        recorded.symlink_to(target)
    with pytest.raises(staging.StagingError):
        staging.open_recorded(agent_dir)
    engine = StandInEngine(local_rank=1)
    rank1 = ck.Checkpointer(engine, default_checkpoint(tmp_path / "ckpt", every=4))
    engine.global_steps = 4
    assert rank1.save(4)
    assert engine.saved_to == [str(tmp_path / "ckpt" / ".staging")]
    assert list(Path(recorded).iterdir()) == []
    leftovers.remove_checkpoint_staging(agent_dir)  # what is not ours is left alone
    assert os.path.lexists(recorded) and not (agent_dir / staging.RECORD).exists()


RANK = """
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from helpers.checkpoint_standins import StandInEngine, StandInSync
from helpers.plan_defaults import default_checkpoint
from nebula_cli.runtime import checkpoint as ck

rank, directory, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{{store}}", rank=rank, world_size=2)
engine = StandInEngine(local_rank=rank, save_delay=0.5 * rank)  # rank 1 writes late
saver = ck.Checkpointer(engine, default_checkpoint(directory, every=5),
                       sync=StandInSync(rank, rank=rank, world=2))
for step in (5, 10):
    engine.global_steps = step
    assert saver.save(step)
saver.close()
dist.barrier()
fresh = StandInEngine(seed=7, local_rank=rank)
loaded = ck.Checkpointer(fresh, default_checkpoint(directory)).load_newest()
print(json.dumps({{"saved_to": engine.saved_to, "loaded": loaded,
                   "steps": fresh.global_steps}}))
dist.destroy_process_group()
"""


def test_the_ranks_of_one_host_stage_in_the_directory_their_writer_made(
        tmp_path: Path, agent_dir: Path) -> None:
    """Two real ranks of one host (local ranks 0 and 1, a gloo world): rank 1 finds the
    writer's staging directory through the agent's folder, writes its shard there (half a
    second after the writer wrote its own: the writer publishes only once both are written),
    and the published checkpoint holds both shards; both load it back."""
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(tests=str(REPO / "tests")))
    directory, store = tmp_path / "ckpt", tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(directory), str(store)],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    dirs = {d for out in outs for d in out["saved_to"]}
    assert len(dirs) == 1 and Path(dirs.pop()).parent == SHM  # one staging dir, in memory
    assert all(out["loaded"] == 10 and out["steps"] == 10 for out in outs)
    assert {p.name for p in (directory / "step10").iterdir()} >= {
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        outer_files.file_name(0), outer_files.file_name(1)}  # each rank's outer shard, too
    assert staging.recorded(agent_dir) is None  # the writer removed it at close


def test_a_restarted_writer_replaces_what_a_killed_one_left(tmp_path: Path,
                                                            agent_dir: Path) -> None:
    """A writer killed mid-save leaves its staging directory full; the next process of the
    host (a restart, a resume) removes it before it makes its own, under a new name."""
    settings = default_checkpoint(tmp_path / "ckpt", every=2)
    first = ck.Checkpointer(StandInEngine(), settings)
    assert first.save(2)
    first.wait()
    killed = staging.recorded(agent_dir)
    assert killed is not None
    (killed / "step4").mkdir()  # what a save killed inside DeepSpeed leaves
    second = ck.Checkpointer(StandInEngine(), settings)
    assert second.load_newest() == 2
    assert not killed.exists() and staging.recorded(agent_dir) is None
    assert second.save(4)
    second.wait()
    new = staging.recorded(agent_dir)
    assert new is not None and new != killed and private(new)
    assert leftovers.remove_checkpoint_staging(agent_dir) == new  # the agent's, at the end
    assert not new.exists() and staging.recorded(agent_dir) is None


def agent_cmd(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "nebula_cli.agent", *args],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


RESTARTED_RANK = """
import os, sys
from pathlib import Path
from nebula_cli.config import staging
agent = staging.agent_dir()
before = staging.recorded(agent)
print("found", before, before is not None and before.exists(), flush=True)
print("made", staging.create(agent), flush=True)
if not Path(sys.argv[1]).exists():
    Path(sys.argv[1]).touch()
    sys.exit(1)
"""


def test_the_agent_removes_the_recorded_directory_before_a_restart_and_at_the_end(
        tmp_path: Path) -> None:
    """A real agent: its rank records a staging directory and fails; the agent removes it (and
    the record) before it restarts the rank, and the second one's at the end."""
    d = tmp_path / "agent"
    d.mkdir(mode=0o700)
    flag = tmp_path / "failed-once"
    (tmp_path / "rank.py").write_text(RESTARTED_RANK)
    cfg = {"job_id": "t", "cluster": "c", "host": "h", "role": "worker", "cwd": str(REPO),
           "grace": 5, "max_restarts": 1, "restart_backoff": 0.2, "processes": [
               {"name": "0", "argv": [sys.executable, str(tmp_path / "rank.py"), str(flag)],
                "env": {"PYTHONPATH": str(REPO)}, "log": "logs/rank0.log", "metrics": None}],
           "rotation": {"max_bytes": 1 << 20, "keep": 2}, "world_secret": ""}
    (d / "agent.json").write_text(json.dumps(cfg))
    try:
        agent_cmd("start", str(d))
        done = wait_for(lambda: (s := agent_cmd("status", str(d))[0])["state"] in (
            "SUCCEEDED", "FAILED") and s, timeout=60)
        assert done["state"] == "SUCCEEDED" and done["restarts"] == 1, done
        wait_for(lambda: not (d / staging.RECORD).exists(), timeout=10)
    finally:
        agent_cmd("stop", "--force", str(d))
    log = (d / "logs/rank0.log").read_text().splitlines()
    assert log[0::2] == ["found None False"] * 2, log  # the first run's was gone before
    made = [Path(line.split()[1]) for line in log[1::2]]
    assert len(made) == 2 and made[0] != made[1] and not any(p.exists() for p in made)


class RunsCode:
    """Unpickling this runs a command: what a replaced outer state file could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_the_outer_state_is_read_as_weights_only(tmp_path: Path, agent_dir: Path) -> None:
    directory, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    saver = ck.Checkpointer(StandInEngine(), default_checkpoint(directory), sync=StandInSync(2))
    assert saver.save(6)
    saver.close()
    outer = directory / "step6" / outer_files.file_name(0)
    torch.save({"theta_global": torch.zeros(3), "round": 2, "extra": RunsCode(marker)}, outer)
    with pytest.raises(SyncError, match="holds more than tensors"):
        ck.Checkpointer(StandInEngine(), default_checkpoint(directory),
                        sync=StandInSync(0)).load_newest()
    assert not marker.exists()


@pytest.mark.parametrize("change", ["writable by others", "another user's file", "a symlink"])
def test_a_checkpoint_someone_else_could_have_written_is_not_unpickled(
        tmp_path: Path, agent_dir: Path, change: str) -> None:
    """DeepSpeed unpickles its own files fully (weights_only=False): a tag with a file another
    user wrote or could write is refused before DeepSpeed reads it, with the fix named."""
    directory = tmp_path / "ckpt"
    saver = ck.Checkpointer(StandInEngine(), default_checkpoint(directory))
    assert saver.save(8)
    saver.close()
    shard = directory / "step8" / StandInEngine().rank_file
    if change == "writable by others":
        shard.chmod(0o666)
    elif change == "another user's file":
        os.chown(shard, OTHER_UID, OTHER_UID)
    else:
        real = tmp_path / "real.pt"
        shard.rename(real)
        shard.symlink_to(real)
    engine = StandInEngine(seed=3)
    with pytest.raises(SyncError, match="chmod -R go-w"):
        ck.Checkpointer(engine, default_checkpoint(directory)).load_newest()
    assert engine.global_steps == 0  # DeepSpeed's load never ran
