"""authorized_keys edits (nebula_cli.agent.authkeys) beside other tools: a line another tool
(ssh-copy-id's append, here a real `sh -c 'echo >> file'`) adds while nebula edits is kept; the
lock is flock on a lock file opened read-write (a byte-range lock on NFS homes, which a
read-only directory descriptor cannot take), seen in /proc/locks; the temporary file is new
(mkstemp), never a symlink someone planted at a name nebula used to compute.

REALWORLD rows: homes on NFS (the Slurm case); hosts where users run ssh-copy-id."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from nebula_cli.agent import authkeys

OURS = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOurs nebula-job-1-tunnel-a"
THEIRS = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITheirs user@laptop"
LATE = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAILate user@desktop"


def keys_file(tmp_path: Path) -> Path:
    ssh = tmp_path / ".ssh"
    ssh.mkdir(mode=0o700)
    path = ssh / "authorized_keys"
    path.write_text(f"{THEIRS}\n")
    path.chmod(0o600)
    return path


def test_a_line_another_tool_adds_meanwhile_is_kept(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    calls: list[list[str]] = []

    def add_ours(lines: list[str]) -> list[str]:
        calls.append(list(lines))
        if len(calls) == 1:  # ssh-copy-id appends while nebula is between its read and rename
            subprocess.run(["sh", "-c", f'echo "{LATE}" >> "$0"', str(path)], check=True)
        return [*lines, OURS]

    assert authkeys.edit(str(path), add_ours, make=True)
    assert path.read_text().splitlines() == [THEIRS, LATE, OURS]
    assert calls == [[THEIRS], [THEIRS, LATE]]  # made again on what the file held then
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert authkeys.remove_tagged(str(path), ["nebula-job-1-tunnel-a"])
    assert path.read_text().splitlines() == [THEIRS, LATE]


def flock_inodes() -> set[int]:
    """Inodes with an exclusive flock held (FLOCK ... WRITE), from /proc/locks."""
    held = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE":
            held.add(int(fields[5].rsplit(":", 1)[1]))
    return held


def test_the_lock_is_a_lock_file_opened_for_writing(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    during: dict[str, object] = {}

    def change(lines: list[str]) -> list[str]:
        held = flock_inodes()
        locked = [p for p in path.parent.iterdir()
                  if p.is_file() and not p.is_symlink() and p.stat().st_ino in held]
        during["locked"] = [(p.name, stat.S_IMODE(p.stat().st_mode)) for p in locked]
        during["directory locked"] = os.stat(path.parent).st_ino in held
        return [*lines, OURS]

    assert authkeys.edit(str(path), change, make=True)
    assert not during["directory locked"] and len(during["locked"]) == 1, during
    lock = authkeys.lock_file(path)
    assert during["locked"] == [(lock.name, 0o600)]
    assert os.stat(lock).st_ino not in flock_inodes()  # released


def test_a_symlink_planted_at_the_old_temporary_name_is_not_followed(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = path.with_name(f".{path.name}.nebula-{os.getpid()}")  # the name nebula computed
    planted.symlink_to(victim)
    assert authkeys.add_lines(str(path), [OURS])
    assert victim.read_text() == "precious\n"
    assert path.read_text().splitlines() == [THEIRS, OURS] and not path.is_symlink()
    assert planted.is_symlink()  # left as it was
    leftovers = {p.name for p in path.parent.iterdir()} - {
        path.name, planted.name, authkeys.lock_file(path).name}
    assert leftovers == set()  # no temporary file left behind
