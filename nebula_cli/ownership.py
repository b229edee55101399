"""Whether a folder is this user's own: a folder, no symlink, owned by this user.

What another user made at a path nebula trusts (a checkpoint folder, OpenSSH's control folder)
could hold what they put there; checked with ``lstat`` before anything in it is used. Standard
library only (hosts load it).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def not_own_folder(path: str | Path) -> str | None:
    """Why `path` is not a folder of this user's ("is a symlink", "is not a folder", "belongs
    to another user (uid N)"), or None when it is one."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    return None
