"""The files of a directory tree to upload: one walk, shared by every transport."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EXCLUDES = (".git", ".venv", "__pycache__", "*.pyc")


@dataclass(frozen=True)
class TreeFile:
    rel: str
    """Path relative to the tree's root, posix style."""
    path: Path
    size: int
    mtime: float
    mode: int
    """Permission bits."""


def excluded(rel: str, patterns: Sequence[str]) -> bool:
    """Whether a relative posix path is excluded: any part, or the whole path, matches."""
    parts = rel.split("/")
    return any(fnmatch.fnmatchcase(part, pat) for pat in patterns for part in parts) or any(
        "/" in pat and fnmatch.fnmatchcase(rel, pat) for pat in patterns)


def walk(root: str | Path, exclude: Sequence[str]) -> tuple[list[str], list[TreeFile]]:
    """(directories, regular files) under `root`, relative, sorted, excluded ones left out.
    `exclude`: fnmatch patterns matched against every path part (or the whole relative path
    when a pattern has a '/'). Dangling symlinks are skipped."""
    root = Path(root)
    dirs: list[str] = []
    files: list[TreeFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = sorted(d for d in dirnames
                             if not excluded(posixpath.join(rel_dir, d), exclude))
        dirs.append(rel_dir)
        for fname in sorted(filenames):
            rel = posixpath.join(rel_dir, fname)
            if excluded(rel, exclude):
                continue
            try:
                st = os.stat(os.path.join(dirpath, fname))
            except OSError:
                continue  # a dangling symlink
            if stat.S_ISREG(st.st_mode):
                files.append(TreeFile(rel, Path(dirpath, fname), st.st_size, st.st_mtime,
                                      st.st_mode & 0o7777))
    return dirs, files


def unchanged(file: TreeFile, size: int | None, mtime: float | None) -> bool:
    """Whether a copy with this size and (whole-second) mtime is already up to date."""
    return size == file.size and mtime is not None and int(mtime) == int(file.mtime)
