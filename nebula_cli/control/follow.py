"""Following files on hosts: log lines (prefixed by cluster/host/rank) and metric records.

Reads are bounded: `--tail N` reads a log backwards from its end in chunks until it has N
lines (never the whole file; into its newest rotated file when the live one holds fewer), the
metrics follower starts at a file's last records, and a host that cannot be reached is
reported once, skipped, and retried with a growing pause.

Rotated files (`config.rotation`): a file found shorter than the offset a follower had
reached was renamed to ``<file>.1`` whole, so the follower reads the rest of ``.1`` from that
offset before the new live file. This holds when a follower polls at least once per
``logs.max_mb`` written (a file rotated and grown past the old offset between two polls would
be read from the old offset).

Lines are cut at `LINE_MAX` bytes: the first `LINE_MAX` bytes of a longer line are shown,
ending in `CUT_MARK`, as soon as they have come, and the rest up to its newline is skipped, so
a process that writes without a newline holds at most `LINE_MAX` bytes of a follower.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebula_cli.agent.summary import SCAN_BYTES
from nebula_cli.config.rotation import rotated
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.final_parameters import newest_finals
from nebula_cli.control.state import HostRecord
from nebula_cli.errors import NebulaError, TransportError
from nebula_cli.transport import Transport

MAX_READ = 1 << 20  # one read of new bytes
TAIL_CHUNK = 64 << 10  # a backwards read of a log's end
TAIL_MAX_BYTES = 16 << 20  # the most `--tail` reads of one log, however long its lines
HISTORY = 2000  # worker records the metrics follower keeps per cluster
RETRY_S = 5.0  # first pause before retrying an unreachable host; doubles up to RETRY_MAX_S
RETRY_MAX_S = 60.0
POLL_TIMEOUT = 120.0  # one poll of every host (each read has its transport's timeouts)
PROBE_LIMIT = 1 << 50  # sizes are probed up to this when a host cannot run a command
LINE_MAX = 1 << 20  # the most bytes of one line shown (and held while it has no newline)
CUT_MARK = f" ... [line cut at {LINE_MAX >> 20} MiB]"

_SIZES = (
    "import json, os, sys\n"
    "def size(p):\n"
    "    try:\n"
    "        return os.stat(os.path.expanduser(p)).st_size\n"
    "    except OSError:\n"
    "        return None\n"
    "print(json.dumps([size(p) for p in sys.argv[1:]]))\n"
)


@dataclass(frozen=True)
class LogLine:
    cluster: str
    host: str
    rank: str  # a worker's rank, or "relay"
    text: str


def file_sizes(transport: Transport, paths: list[str]) -> dict[str, int | None]:
    """path -> size in bytes (None: no such file), with one command on the host; by probing
    with zero-byte reads when the host cannot run it."""
    if not paths:
        return {}
    result = transport.run([transport.python, "-c", _SIZES, *paths], timeout=60)
    try:
        sizes = json.loads(result.stdout) if result.ok else None
    except json.JSONDecodeError:
        sizes = None
    if isinstance(sizes, list) and len(sizes) == len(paths):
        return {p: s if isinstance(s, int) else None for p, s in zip(paths, sizes, strict=True)}
    return {p: probe_size(transport, p) for p in paths}


def probe_size(transport: Transport, path: str) -> int | None:
    """A file's size from `read_tail` alone: a zero-byte read at an offset past the end
    restarts at 0, so the size is the largest offset that reads back as itself."""
    if not transport.exists(path):
        return None

    def within(offset: int) -> bool:
        return transport.read_tail(path, offset, 0)[1] == offset

    high = 1
    while within(high) and high < PROBE_LIMIT:
        high *= 2
    low = high // 2 if high > 1 else 0  # within(low), not within(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if within(mid) else (low, mid)
    return low


class LineTail:
    """Complete lines appended to one file since the last read (a partial line waits).

    With `last` set, the first read shows only the file's last `last` lines (reading at most
    `max_back` bytes of it, from its end) and later reads follow from there. A line longer
    than `LINE_MAX` bytes is shown cut (its first `LINE_MAX` bytes and `CUT_MARK`) once they
    have come; the rest of it is skipped."""

    def __init__(self, transport: Transport, path: str, offset: int = 0, *,
                 last: int | None = None, max_back: int = TAIL_MAX_BYTES) -> None:
        self.transport = transport
        self.path = path
        self.offset = offset
        self.last = last
        self.max_back = max_back
        self._partial = b""
        self._cutting = False  # the line held was shown cut: skip to its newline

    @property
    def held(self) -> int:
        """Bytes held of a line whose newline has not come yet (at most `LINE_MAX`)."""
        return len(self._partial)

    def read_lines(self, final: bool = False, size: int | None = None) -> list[str]:
        """New complete lines; with final=True also a last line that has no newline yet.
        `size`: the file's size when known (saves asking for it on a first `last` read)."""
        if self.last is not None:
            lines = self._read_last(self.last, size)
            self.last = None
        else:
            lines = self._read_new()
        if final and self._partial:
            lines.append(_text(self._partial))
        if final:
            self._partial, self._cutting = b"", False
        return lines

    def _split(self, data: bytes) -> list[str]:
        """The lines `data` completes after what is held, each cut at `LINE_MAX` bytes; an
        unterminated end is held (or shown cut and skipped, once longer than `LINE_MAX`)."""
        out = []
        pieces = data.split(b"\n")
        for i, piece in enumerate(pieces):
            ends = i < len(pieces) - 1  # a newline follows this piece
            if self._cutting:
                self._cutting = not ends
                continue
            line = self._partial + piece
            self._partial = b""
            if len(line) > LINE_MAX:
                out.append(_text(line[:LINE_MAX]) + CUT_MARK)
                self._cutting = not ends
            elif ends:
                out.append(_text(line))
            else:
                self._partial = line
        return out

    def _read_new(self) -> list[str]:
        lines = []
        while True:
            data, new_offset = self.transport.read_tail(self.path, self.offset, MAX_READ)
            if new_offset - len(data) < self.offset:  # shorter than where we were: rotated
                lines += self._split(self._rest_of_rotated())  # (or replaced: nothing to go on)
            self.offset = new_offset
            if not data:
                break
            lines += self._split(data)
            if len(data) < MAX_READ:
                break
        return lines

    def _rest_of_rotated(self) -> bytes:
        """What the file we were reading got after our offset, now that it is ``<path>.1``
        (`config.rotation` renames it whole). Nothing when ``.1`` is not that file (shorter
        than our offset: the file was replaced, or rotated twice since the last read)."""
        older, offset, parts = rotated(self.path, 1), self.offset, []
        while True:
            data, after = self.transport.read_tail(older, offset, MAX_READ)
            if not data or after - len(data) != offset:
                break
            parts.append(data)
            offset = after
        if not parts:  # not the same file: a partial line of it cannot go on
            self._partial, self._cutting = b"", False
        return b"".join(parts)

    def _read_last(self, n: int, size: int | None) -> list[str]:
        if size is None:
            size = file_sizes(self.transport, [self.path]).get(self.path)
        if size is None:  # no such file yet: follow it from its start
            self.offset = 0
            return []
        buf, pos = self._back(self.path, size, n, self.max_back)
        if pos == 0 and buf.count(b"\n") <= n and len(buf) < self.max_back:
            older = rotated(self.path, 1)  # a live file shorter than asked: its rotated one
            older_size = file_sizes(self.transport, [older]).get(older)
            if older_size:
                more, pos = self._back(older, older_size, n - buf.count(b"\n"),
                                       self.max_back - len(buf))
                buf = more + buf
        if pos > 0 and b"\n" in buf:  # the first line may have started before what was read
            buf = buf[buf.index(b"\n") + 1:]
        self._partial, self._cutting = b"", False
        lines = self._split(buf)
        self.offset = size
        return lines[-n:] if n else []

    def _back(self, path: str, size: int, n: int, budget: int) -> tuple[bytes, int]:
        """The end of `path` (`size` bytes) read backwards until it holds more than `n`
        lines or `budget` bytes; the bytes and where they start."""
        pos, buf = size, b""
        while pos > 0 and buf.count(b"\n") <= n and size - pos < budget:
            step = min(TAIL_CHUNK, pos, budget - (size - pos))
            data, end = self.transport.read_tail(path, pos - step, step)
            if end != pos or len(data) != step:  # replaced meanwhile: keep what we have
                break
            pos -= step
            buf = data + buf
        return buf, pos


def _text(line: bytes) -> str:
    return line.decode(errors="replace").rstrip("\r")


class Reachability:
    """Which hosts could not be reached: reported once per outage, retried after a pause."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.problems: list[str] = []  # messages not yet shown; see `take`
        self._down: dict[str, tuple[float, float]] = {}  # label -> (retry at, pause)

    def due(self, label: str) -> bool:
        down = self._down.get(label)
        return down is None or self.clock() >= down[0]

    def failed(self, label: str, exc: Exception) -> None:
        down = self._down.get(label)
        if down is None:
            self.problems.append(f"{label}: {exc} (skipped; retrying)")
            pause = RETRY_S
        else:
            pause = min(down[1] * 2, RETRY_MAX_S)
        self._down[label] = (self.clock() + pause, pause)

    def reached(self, label: str) -> None:
        if self._down.pop(label, None) is not None:
            self.problems.append(f"{label}: reachable again")

    @property
    def down(self) -> list[str]:
        return list(self._down)

    def take(self) -> list[str]:
        out, self.problems = self.problems, []
        return out


def log_sources(rec: HostRecord) -> dict[str, str]:
    """rank -> absolute log path for one agent."""
    return {
        rank: posixpath.join(rec.agent_dir, rel)
        for rank, rel in rec.detail.get("logs", {}).items()
    }


def metric_sources(rec: HostRecord) -> dict[str, str]:
    """rank -> absolute metrics path for one agent."""
    return {
        rank: posixpath.join(rec.agent_dir, rel)
        for rank, rel in rec.detail.get("metrics", {}).items()
    }


def host_label(rec: HostRecord) -> str:
    return f"{rec.cluster}/{rec.host}"


class LogFollower:
    """New log lines of a job's agents, filtered by cluster, host and rank. With `tail`, the
    first poll shows each log's last `tail` lines. A host that cannot be reached is named in
    `reach.problems` once and skipped until it answers again."""

    def __init__(
        self,
        hosts: list[HostRecord],
        transport_of: Callable[[HostRecord], Transport],
        *,
        cluster: str | None = None,
        host: str | None = None,
        rank: str | None = None,
        tail: int | None = None,
    ) -> None:
        self.tails: list[tuple[HostRecord, str, LineTail]] = []
        self.reach = Reachability()
        self.read_any = False  # whether any log could be read yet
        for rec in hosts:
            if (cluster and rec.cluster != cluster) or (host and rec.host != host):
                continue
            for r, path in log_sources(rec).items():
                if rank is not None and r != rank:
                    continue
                self.tails.append((rec, r, LineTail(transport_of(rec), path, last=tail)))

    def poll(self, final: bool = False) -> list[LogLine]:
        """New lines of every reachable log (a final poll also tries hosts that are down)."""
        out: list[LogLine] = []
        groups: dict[str, list[tuple[HostRecord, str, LineTail]]] = {}
        for entry in self.tails:
            groups.setdefault(host_label(entry[0]), []).append(entry)
        due = {label: group for label, group in groups.items()
               if final or self.reach.due(label)}
        try:  # hosts in parallel: one that is down does not hold up the others
            results: dict[object, object] = dict(fanout(
                list(due), lambda label: self._read_host(due[label], final),
                timeout=POLL_TIMEOUT, cancel=_reads_end_by_themselves))
        except GroupError as exc:
            results = exc.results
        for label in due:
            result = results[label]
            if isinstance(result, BaseException):
                if not isinstance(result, (NebulaError, TimeoutError)):
                    raise result
                self.reach.failed(label, result)  # type: ignore[arg-type]
                continue
            out += result  # type: ignore[arg-type]
            self.reach.reached(label)
            self.read_any = True
        return out

    @staticmethod
    def _read_host(group: list[tuple[HostRecord, str, LineTail]], final: bool) -> list[LogLine]:
        first = [lt for _, _, lt in group if lt.last is not None]
        sizes = file_sizes(first[0].transport, [lt.path for lt in first]) if first else {}
        out = []
        for rec, r, lt in group:
            lines = lt.read_lines(final=final, size=sizes.get(lt.path))
            out += [LogLine(rec.cluster, rec.host, r, t) for t in lines]
        return out


def _reads_end_by_themselves() -> None:
    """A poll's reads need no cancelling: each is bounded by its transport's timeouts."""


def parse_metric(line: str) -> dict[str, Any] | None:
    """One metrics JSON line, or None when it is not one (partial, corrupt, not an object)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


class MetricsFollower:
    """The newest metrics of every cluster (workers) and every relay, updated by `poll`.

    Starts at each file's last records (at most SCAN_BYTES of it); keeps at most `history`
    worker records per cluster and one final record per rank: its memory does not grow with
    the run."""

    def __init__(
        self, hosts: list[HostRecord], transport_of: Callable[[HostRecord], Transport],
        *, history: int = HISTORY,
    ) -> None:
        self.tails = [
            (rec, LineTail(transport_of(rec), path, last=history, max_back=SCAN_BYTES))
            for rec in hosts
            for path in metric_sources(rec).values()
        ]
        self.reach = Reachability()
        self.latest: dict[str, dict[str, Any]] = {}  # cluster -> merged newest worker values
        self.relay: dict[str, dict[str, Any]] = {}  # cluster -> newest relay record
        self.history: dict[str, deque[dict[str, Any]]] = {}  # cluster -> newest worker records
        self.finals: list[dict[str, Any]] = []  # every rank's newest `final` record
        self._history_len = history

    def poll(self) -> None:
        for rec, lt in self.tails:
            label = host_label(rec)
            if not self.reach.due(label):
                continue
            try:
                lines = lt.read_lines()
            except TransportError as exc:
                self.reach.failed(label, exc)
                continue
            self.reach.reached(label)
            for line in lines:
                m = parse_metric(line)
                if m is not None:
                    self._fold(rec, m)

    def _fold(self, rec: HostRecord, m: dict[str, Any]) -> None:
        if rec.role == "relay":
            self.relay.setdefault(rec.cluster, {}).update(m)
        elif m.get("final"):
            self.finals = newest_finals([*self.finals,
                                         {"cluster": rec.cluster, "host": rec.host, **m}])
            self.latest.setdefault(rec.cluster, {}).update(
                {k: v for k, v in m.items() if k in ("step", "eval_loss")})
        else:
            self.latest.setdefault(rec.cluster, {}).update(m)
            self.history.setdefault(rec.cluster, deque(maxlen=self._history_len)).append(m)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
