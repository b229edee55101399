"""config/rotation.py: appends past the bound rotate by rename, lose nothing that is kept, never
cut a line, and keep a file's bytes on disk under `Rotation.bound` however much is written."""

from __future__ import annotations

import os
from pathlib import Path

from nebula_cli.config.rotation import (
    LINE_SLACK,
    Rotation,
    append,
    paths_oldest_first,
    rotate,
)


def _lines(path: Path, keep: int) -> list[str]:
    out: list[str] = []
    for p in paths_oldest_first(str(path), keep):
        if os.path.exists(p):
            data = Path(p).read_bytes()
            assert not data or data.endswith(b"\n"), p  # a rotated file ends at a line's end
            out += data.decode().splitlines()
    return out


def test_appends_past_the_bound_keep_every_line_in_order(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "rank0.jsonl"
    rotation = Rotation(max_bytes=4096, keep=1000)  # keeps everything: nothing may be lost
    written = [f'{{"step": {i}, "loss": {i / 7:.6f}}}' for i in range(5000)]
    for i in range(0, len(written), 7):  # several lines per append, as the relay writes
        append(path, "".join(x + "\n" for x in written[i:i + 7]).encode(), rotation)
    assert _lines(path, 1000) == written
    files = [p for p in paths_oldest_first(str(path), 1000) if os.path.exists(p)]
    assert len(files) > 20  # it did rotate, many times
    assert all(os.path.getsize(p) <= rotation.max_bytes for p in files)  # whole lines fit


def test_a_partial_line_is_finished_before_the_file_rotates(tmp_path: Path) -> None:
    """The log pump appends what it read, which may end within a line."""
    path = tmp_path / "rank0.log"
    rotation = Rotation(max_bytes=100, keep=10)
    append(path, b"a" * 90, rotation)
    append(path, b"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb\nnext line\n", rotation)
    assert Path(f"{path}.1").read_bytes() == b"a" * 90 + b"b" * 41 + b"\n"
    assert path.read_bytes() == b"next line\n"


def test_disk_use_stays_under_the_bound_and_the_newest_lines_stay(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "rank0.log"
    rotation = Rotation(max_bytes=10_000, keep=2)
    written = [f"line {i} " + "x" * (i % 50) for i in range(6_000)]
    for line in written:
        append(path, (line + "\n").encode(), rotation)
    used = sum(os.path.getsize(p) for p in paths_oldest_first(str(path), 5) if os.path.exists(p))
    assert used <= rotation.bound()
    assert not os.path.exists(f"{path}.3")  # older ones removed
    kept = _lines(path, 2)
    assert kept == written[-len(kept):]  # a contiguous, newest suffix: nothing in between lost
    assert used > 2 * rotation.max_bytes  # and the bound is not met by keeping too little


def test_a_line_longer_than_a_file_is_cut_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    rotation = Rotation(max_bytes=1000, keep=100)
    big = b"y" * (3 * (1000 + LINE_SLACK)) + b"\n"
    append(path, b"a\n", rotation)
    append(path, big, rotation)
    data = b"".join(Path(p).read_bytes() for p in paths_oldest_first(str(path), 100)
                    if os.path.exists(p))
    assert data == b"a\n" + big


def test_rotate_shifts_and_drops_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "f"
    for n in range(4):
        path.write_text(f"gen {n}\n")
        rotate(path, 2)
    assert not path.exists()
    assert Path(f"{path}.1").read_text() == "gen 3\n"
    assert Path(f"{path}.2").read_text() == "gen 2\n"
    assert not Path(f"{path}.3").exists()


def test_rotation_travels_in_the_environment() -> None:
    rotation = Rotation(max_bytes=123, keep=4)
    assert Rotation.from_env(rotation.to_env()) == rotation
    assert Rotation.from_env("") is None and Rotation.from_env("x:1") is None
    assert Rotation.from_env("0:3") is None  # never rotating at 0 bytes
