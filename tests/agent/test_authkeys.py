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
import sys
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
    assert during["locked"] == [(authkeys.lock_file(path).name, 0o600)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["authorized_keys"]  # removed


def test_edits_from_many_processes_at_once_lose_no_line(tmp_path: Path) -> None:
    """Eight processes each add their own lines and remove some, at once: every line that
    should be there is, once."""
    path = keys_file(tmp_path)
    script = ("import sys\nfrom nebula_cli.agent import authkeys\n"
              "p, i = sys.argv[1], sys.argv[2]\n"
              "for k in range(15):\n"
              "    authkeys.add_lines(p, [f'ssh-ed25519 AAAA{i}x{k} nebula-t:{i}:{k}'])\n"
              "    if k % 3 == 0:\n"
              "        authkeys.remove_tagged(p, [f'nebula-t:{i}:{k}'])\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(i)])
             for i in range(8)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    expected = {f"nebula-t:{i}:{k}" for i in range(8) for k in range(15) if k % 3}
    lines = path.read_text().splitlines()
    assert lines[0] == THEIRS and sorted(authkeys.comment(x) for x in lines[1:]) == sorted(
        expected)
    assert sorted(p.name for p in path.parent.iterdir()) == ["authorized_keys"]


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
    leftovers = {p.name for p in path.parent.iterdir()} - {path.name, planted.name}
    assert leftovers == set()  # no temporary file, no lock file left behind
