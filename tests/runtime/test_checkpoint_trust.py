"""runtime/checkpoint_trust.py through runtime/checkpoint.py: a checkpoint folder that another
user could replace from above (an ancestor writable by every user and not sticky, writable by a
group with other members, or owned by another user) is neither loaded nor written to, and the
error names the ancestor and the fix; a sticky ancestor (/tmp) and a group of this user alone
are fine; an existing `checkpoint.dir` of another user is not written to. Real folders, real
modes and owners (the other user is a real uid: nobody, whose group nogroup has several
members), the checkpoints saved and loaded by the real Checkpointer (a stand-in engine)."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.checkpoint_standins import StandInEngine
from helpers.plan_defaults import default_checkpoint

from nebula_cli.runtime import checkpoint as ck
from nebula_cli.runtime import checkpoint_trust as trust
from nebula_cli.runtime import metrics
from nebula_cli.runtime.outer import SyncError

OTHER_UID = 65534  # nobody
SHARED_GID = 65534  # nogroup: nobody's, and the primary group of other system users too
FIX = "mkdir -m 700"

# (mode, owner, group) of the checkpoint folder's parent, and what it should say (None: fine)
ANCESTORS = {
    "writable by every user": ((0o777, None, None), "is writable by every user (mode 0777)"),
    "another user's": ((0o755, OTHER_UID, None), f"belongs to another user (uid {OTHER_UID})"),
    "writable by a group with other members": (
        (0o775, None, SHARED_GID), "is writable by group nogroup, which has other members"),
    "setgid, writable by a group with other members": (
        (0o2775, None, SHARED_GID), "is writable by group nogroup"),
}
FINE = {
    "sticky and writable by every user": (0o1777, None, None),
    "writable by a group of this user alone": (0o770, None, os.getgid()),
}


@pytest.fixture
def base(tmp_path: Path) -> Iterator[Path]:
    """A folder whose mode and owner a test changes (the checkpoint folder goes below it)."""
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    yield path
    os.chown(path, os.getuid(), os.getgid())
    path.chmod(0o700)
    shutil.rmtree(path)


def _make(base: Path, mode: int, uid: int | None, gid: int | None) -> None:
    os.chown(base, -1 if uid is None else uid, -1 if gid is None else gid)
    base.chmod(mode)  # after chown, which clears setgid


def _saved(directory: Path) -> None:
    engine = StandInEngine()
    engine.global_steps = 8
    saver = ck.Checkpointer(engine, default_checkpoint(directory))
    assert saver.save(8)
    saver.close()
    assert ck.complete_steps(directory) == [8]


def test_the_other_group_really_has_other_members() -> None:
    """What the group cases stand on: nogroup is nobody's primary group, and not ours alone."""
    assert grp.getgrgid(SHARED_GID).gr_name == "nogroup"
    out = subprocess.run(["getent", "passwd"], capture_output=True, text=True, check=True)
    assert any(line.split(":")[3] == str(SHARED_GID) for line in out.stdout.splitlines())


@pytest.mark.parametrize("kind", list(ANCESTORS))
def test_a_checkpoint_another_user_could_replace_from_above_is_not_loaded(
        base: Path, kind: str) -> None:
    directory = base / "ckpt"
    _saved(directory)  # saved while the parent was private
    (mode, uid, gid), said = ANCESTORS[kind]
    _make(base, mode, uid, gid)
    engine = StandInEngine(seed=3)
    with pytest.raises(SyncError) as err:
        ck.Checkpointer(engine, default_checkpoint(directory)).load_newest()
    assert f"its ancestor {base} {said}" in str(err.value)
    assert FIX in str(err.value)
    assert engine.global_steps == 0  # DeepSpeed's load never ran


@pytest.mark.parametrize("kind", list(FINE))
def test_a_sticky_ancestor_or_a_group_of_this_user_alone_is_fine(base: Path, kind: str) -> None:
    directory = base / "ckpt"
    _make(base, *FINE[kind])
    _saved(directory)
    engine = StandInEngine(seed=3)
    assert ck.Checkpointer(engine, default_checkpoint(directory)).load_newest() == 8
    assert engine.global_steps == 8


def test_an_ancestor_reached_through_a_symlink_is_checked_where_it_resolves(
        base: Path, tmp_path: Path) -> None:
    directory = base / "ckpt"
    _saved(directory)
    _make(base, 0o777, None, None)
    link = tmp_path / "link"
    link.symlink_to(base)  # the spec names the link; the folder it reaches is open to all
    with pytest.raises(SyncError) as err:
        ck.Checkpointer(StandInEngine(), default_checkpoint(link / "ckpt")).load_newest()
    assert f"its ancestor {link} (that is, {base}) is writable by every user" in str(err.value)


def test_a_symbolic_link_of_another_user_on_the_way_is_refused(base: Path, tmp_path: Path
                                                              ) -> None:
    """A link another user owns, in a sticky folder (so nobody else can touch it), pointing at
    this user's own safe folder: its owner can point it elsewhere between the check and
    DeepSpeed's load of the named path, so it is refused; the same link of this user's is
    fine."""
    directory = base / "ckpt"
    _saved(directory)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    link = sticky / "theirs"
    link.symlink_to(base)
    try:
        os.lchown(link, OTHER_UID, -1)
        with pytest.raises(SyncError) as err:
            ck.Checkpointer(StandInEngine(), default_checkpoint(link / "ckpt")).load_newest()
        assert (f"its ancestor {link} is a symbolic link of another user (uid {OTHER_UID}), "
                "who can point it elsewhere") in str(err.value)
        os.lchown(link, os.getuid(), -1)  # the user's own link: nothing to say
        assert trust.unsafe_ancestors(link / "ckpt") == []
    finally:
        link.unlink()


@pytest.mark.parametrize("kind", ["another user's folder", "an ancestor open to every user"])
def test_no_checkpoint_is_written_where_another_user_could_replace_it(
        base: Path, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(metrics.METRICS_FILE_ENV, str(records))
    directory = base / "ckpt"
    if kind == "another user's folder":  # made before the job, open to the job's user
        _make(base, 0o755, None, None)
        directory.mkdir()
        directory.chmod(0o777)
        os.chown(directory, OTHER_UID, OTHER_UID)
        said = f"checkpoint directory {directory} not used: belongs to another user"
    else:
        _make(base, 0o777, None, None)
        said = f"not used: its ancestor {base} is writable by every user"
    engine = StandInEngine()
    engine.global_steps = 8
    saver = ck.Checkpointer(engine, default_checkpoint(directory))
    try:
        assert saver.save(8) is False
    finally:
        saver.close()
    assert said in records.read_text() and FIX in records.read_text()
    assert not (directory / "step8").exists() and not (directory / ".staging").exists()
