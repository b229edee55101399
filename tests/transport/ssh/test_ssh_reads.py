"""Cheap reads over a real sshd on loopback: file sizes in one command (or probed with
zero-byte SFTP reads when the host has no python), and a log's tail read from its end."""

from __future__ import annotations

import pwd
from pathlib import Path

from helpers.sshd_bed import Bed

from nebula_cli.control.follow import LineTail, file_sizes, probe_size


def test_sizes_and_tail_over_ssh(bed: Bed) -> None:
    base = f"{bed.remote_dir}/cheap"
    home = Path(pwd.getpwuid(0).pw_dir)
    local = home / base[2:]
    local.mkdir(parents=True, exist_ok=True)
    lines = [f"line {i}" for i in range(200_000)]
    (local / "big.log").write_text("\n".join(lines) + "\n")
    size = (local / "big.log").stat().st_size
    paths = [f"{base}/big.log", f"{base}/missing.log"]
    with bed.transport(python="python3") as t:
        assert file_sizes(t, paths) == {paths[0]: size, paths[1]: None}
        read: list[int] = []
        original = t.read_tail

        def counted(remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
            data, end = original(remote, offset, max_bytes)
            read.append(len(data))
            return data, end

        t.read_tail = counted  # type: ignore[method-assign]
        tail = LineTail(t, paths[0], last=5)
        assert tail.read_lines() == lines[-5:]
        assert sum(read) <= 64 << 10 < size
        with open(local / "big.log", "a") as fh:
            fh.write("one more\n")
        assert tail.read_lines() == ["one more"]
    with bed.transport(python="false") as t:  # a host where the command fails: probe instead
        assert probe_size(t, paths[0]) == size + len("one more\n")
        assert file_sizes(t, paths) == {paths[0]: size + len("one more\n"), paths[1]: None}
