"""Whether another user could replace a checkpoint folder from above: its ancestors.

DeepSpeed reopens a checkpoint by path after nebula checked it (`checkpoint.check_loadable`)
and unpickles it, which runs code. A user who can rename entries of a folder on the way to
`checkpoint.dir` can swap the checkpoint for their own between the check and the load, so
every ancestor must be one only this user (or root) controls: owned by root or this user, and
writable by nobody else unless sticky (``/tmp``: others cannot rename what is not theirs).
"Somebody else can write" is o+w, or g+w when the folder's group has a member other than this
user (named in the group, or having it as their primary group: setgid project folders on HPC
sites are common, a user's private group is not another user). The folders as named and as
resolved (through symlinks) are both checked, and a symbolic link on the way as named (the
folder itself too) must be this user's or root's: DeepSpeed opens the named path, and a link's
owner can point it elsewhere whatever folder it lies in (in a sticky one too: delete, make
again). Standard library only.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

FIX = ("use a folder of your own with mode 0700 for `checkpoint.dir` (`mkdir -m 700 "
       "~/checkpoints`), under folders only you and root can write")


def _group_has_others(gid: int) -> bool:
    """Whether group `gid` has a member other than this user (an unknown group may)."""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return True
    members |= {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    return bool(members - {me})


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _problem(path: Path, info: os.stat_result) -> str | None:
    real = os.path.realpath(path)
    where = str(path) if real == str(path) else f"{path} (that is, {real})"
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (0, os.getuid()):
        return f"its ancestor {where} belongs to another user (uid {info.st_uid})"
    if mode & stat.S_ISVTX:
        return None
    if mode & 0o002:
        return f"its ancestor {where} is writable by every user (mode {mode:04o})"
    if mode & 0o020 and _group_has_others(info.st_gid):
        return (f"its ancestor {where} is writable by group {_group_name(info.st_gid)}, "
                f"which has other members (mode {mode:04o})")
    return None


def unsafe_ancestors(directory: Path) -> list[str]:
    """What lets another user replace `directory` from above: a symbolic link of another user
    on the way as named (`directory` itself too); each ancestor (as named and as resolved;
    those that do not exist yet skipped) that is not this user's or root's, or that somebody
    else can write and is not sticky. Empty when there is none."""
    seen: set[tuple[int, int]] = set()
    found: list[str] = []
    named = Path(os.path.abspath(directory))
    for link in [*reversed(named.parents), named]:
        try:
            info = os.lstat(link)
        except OSError:
            continue
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, os.getuid()):
            found.append(f"its ancestor {link} is a symbolic link of another user (uid "
                         f"{info.st_uid}), who can point it elsewhere")
    for path in (named, Path(os.path.realpath(directory))):
        for ancestor in reversed(path.parents):
            try:
                info = os.stat(ancestor)
            except OSError:
                continue
            if (info.st_dev, info.st_ino) in seen:
                continue
            seen.add((info.st_dev, info.st_ino))
            if (problem := _problem(ancestor, info)) is not None:
                found.append(problem)
    return found
