"""Following files on hosts: log lines (prefixed by cluster/host/rank) and metric records."""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nebula_cli.control.state import HostRecord
from nebula_cli.errors import TransportError
from nebula_cli.transport import Transport

MAX_READ = 1 << 20


@dataclass(frozen=True)
class LogLine:
    cluster: str
    host: str
    rank: str  # a worker's rank, or "relay"
    text: str


class LineTail:
    """Complete lines appended to one file since the last read (a partial line waits)."""

    def __init__(self, transport: Transport, path: str, offset: int = 0) -> None:
        self.transport = transport
        self.path = path
        self.offset = offset
        self._partial = b""

    def read_lines(self, final: bool = False) -> list[str]:
        """New complete lines; with final=True also a last line that has no newline yet."""
        chunks = []
        while True:
            data, new_offset = self.transport.read_tail(self.path, self.offset, MAX_READ)
            if new_offset < self.offset:  # the file was replaced: start over
                self._partial = b""
            self.offset = new_offset
            if not data:
                break
            chunks.append(data)
            if len(data) < MAX_READ:
                break
        buf = self._partial + b"".join(chunks)
        lines = buf.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [ln.decode(errors="replace").rstrip("\r") for ln in lines]


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


class LogFollower:
    """New log lines of a job's agents, filtered by cluster, host and rank."""

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
        self.backlog: list[LogLine] = []
        for rec in hosts:
            if (cluster and rec.cluster != cluster) or (host and rec.host != host):
                continue
            for r, path in log_sources(rec).items():
                if rank is not None and r != rank:
                    continue
                lt = LineTail(transport_of(rec), path)
                if tail is not None:
                    lines = lt.read_lines(final=False)
                    self.backlog += [
                        LogLine(rec.cluster, rec.host, r, t) for t in lines[-tail:] if tail
                    ]
                self.tails.append((rec, r, lt))

    def poll(self, final: bool = False) -> list[LogLine]:
        out, self.backlog = self.backlog, []
        for rec, r, lt in self.tails:
            try:
                lines = lt.read_lines(final=final)
            except TransportError:
                continue  # a host briefly unreachable: try again on the next poll
            out += [LogLine(rec.cluster, rec.host, r, t) for t in lines]
        return out


def parse_metric(line: str) -> dict[str, Any] | None:
    """One metrics JSON line, or None when it is not one (partial, corrupt, not an object)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) else None


class MetricsFollower:
    """The newest metrics of every cluster (workers) and every relay, updated by `poll`."""

    def __init__(
        self, hosts: list[HostRecord], transport_of: Callable[[HostRecord], Transport]
    ) -> None:
        self.tails = [
            (rec, LineTail(transport_of(rec), path))
            for rec in hosts
            for path in metric_sources(rec).values()
        ]
        self.latest: dict[str, dict[str, Any]] = {}  # cluster -> merged newest worker values
        self.relay: dict[str, dict[str, Any]] = {}  # cluster -> newest relay record
        self.history: dict[str, list[dict[str, Any]]] = {}  # cluster -> worker records
        self.finals: list[dict[str, Any]] = []  # every rank's `final` record

    def poll(self) -> None:
        for rec, lt in self.tails:
            try:
                lines = lt.read_lines()
            except TransportError:
                continue
            for line in lines:
                m = parse_metric(line)
                if m is None:
                    continue
                if rec.role == "relay":
                    self.relay.setdefault(rec.cluster, {}).update(m)
                elif m.get("final"):
                    self.finals.append({"cluster": rec.cluster, "host": rec.host, **m})
                    self.latest.setdefault(rec.cluster, {}).update(
                        {k: v for k, v in m.items() if k in ("step", "eval_loss")})
                else:
                    self.latest.setdefault(rec.cluster, {}).update(m)
                    self.history.setdefault(rec.cluster, []).append(m)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
