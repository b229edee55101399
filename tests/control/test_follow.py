"""control/follow.py: a line that does not end is held up to `LINE_MAX` bytes, then shown cut
(its first `LINE_MAX` bytes and `CUT_MARK`) and the rest of it skipped, so `nebula logs -f` and
the live view hold at most `LINE_MAX` of it, however long it gets. A real writer process, real
files read through a real LocalTransport, and `nebula logs -f` on a real job."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.jobs import CLI, write_spec

from nebula_cli.control.follow import CUT_MARK, LINE_MAX, LineTail
from nebula_cli.transport import LocalTransport

# Appends what each line of its stdin asks (`<byte> <count>`, `nl` for a newline, `text <t>`
# for a whole line) to a file and says `ok` once it is written.
WRITER = '''
import sys
with open(sys.argv[1], "ab", buffering=0) as f:
    for cmd in sys.stdin:
        what, _, arg = cmd.rstrip("\\n").partition(" ")
        if what == "nl":
            f.write(b"\\n")
        elif what == "text":
            f.write(arg.encode() + b"\\n")
        else:
            f.write(what.encode() * int(arg))
        print("ok", flush=True)
'''


class Writer:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def __call__(self, cmd: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n"


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Writer]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "rank0.log")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield Writer(proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _tail(tmp_path: Path, **kw: int) -> LineTail:
    transport = LocalTransport("e1", home=str(tmp_path), python=sys.executable)
    return LineTail(transport, str(tmp_path / "rank0.log"), **kw)


def test_a_line_without_end_is_shown_cut_and_never_held_past_the_bound(
        tmp_path: Path, writer: Writer) -> None:
    writer("text first")
    tail = _tail(tmp_path)
    assert tail.read_lines() == ["first"]
    got = []
    for _ in range(12):  # 3 MiB of one line, 256 KiB a poll: no newline yet
        writer(f"x {LINE_MAX // 4}")
        got += tail.read_lines()
        assert tail.held <= LINE_MAX
    assert got == ["x" * LINE_MAX + CUT_MARK]  # shown once, as soon as it passed the bound
    writer("x 10")
    writer("nl")
    writer("text next")
    assert tail.read_lines() == ["next"]  # the rest of the cut line skipped, no more
    writer(f"z {2 * LINE_MAX}")  # a long line that ends within one read
    writer("nl")
    writer(f"w {LINE_MAX}")  # exactly the bound: whole
    writer("nl")
    assert tail.read_lines() == ["z" * LINE_MAX + CUT_MARK, "w" * LINE_MAX]
    assert tail.held == 0


def test_tail_of_a_log_that_ends_in_a_long_line_shows_it_cut(
        tmp_path: Path, writer: Writer) -> None:
    writer("text one")
    writer(f"y {3 * LINE_MAX}")
    tail = _tail(tmp_path, last=5)
    assert tail.read_lines() == ["one", "y" * LINE_MAX + CUT_MARK]
    assert tail.held == 0
    writer("y 5")
    writer("nl")
    writer("text two")
    assert tail.read_lines() == ["two"]


# A worker that writes 3 MiB without a newline, then ends the line and says one more.
LONG = '''
import sys, time
for _ in range(12):
    sys.stdout.write("x" * (1 << 18))
    sys.stdout.flush()
    time.sleep(0.05)
print()
print("after the long line", flush=True)
'''


def test_logs_follow_shows_a_long_line_cut(cli: CLI, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "long.py").write_text(LONG)
    spec = write_spec(tmp_path, f"""
        name: long
        workdir: {work}
        run: python long.py
        clusters:
          - {{name: east, transport: local, hosts: [{{host: e1}}]}}
        """)
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()
    out = cli("logs", job_id, "-f", timeout=300, check=True).stdout.splitlines()
    long = [line for line in out if "xxxx" in line]
    assert len(long) == 1, [line[:80] for line in long]
    assert long[0].endswith("x" * 1000 + CUT_MARK)
    assert long[0].count("x") == LINE_MAX
    assert any(line.endswith("after the long line") for line in out)
