"""The newest metrics of a recorded job, for `status`, without re-reading metrics files.

Each agent answers `status` with a small summary per metrics file (`nebula_cli.agent.summary`);
`JobOps` keeps the last one of every host in its record (``detail["metrics_summary"]``), so an
ended job's figures need no host at all. An agent too old to answer with one is summarised
here from the tail of each file, read over the transport (at most SCAN_BYTES per file).
`view` merges the hosts' summaries into what the tables show.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nebula_cli.agent import summary
from nebula_cli.config import plan_model
from nebula_cli.config.rotation import rotated
from nebula_cli.control.follow import file_sizes, metric_sources
from nebula_cli.control.state import END_STATES, HostRecord
from nebula_cli.transport import Transport

SUMMARY_KEY = "metrics_summary"
AGENT, TAIL = "agent", "tail"  # where a stored summary came from


@dataclass
class MetricsView:
    """What `status` shows: per cluster the newest worker values and the newest relay values,
    and every rank's final record."""

    latest: dict[str, dict[str, Any]] = field(default_factory=dict)
    relay: dict[str, dict[str, Any]] = field(default_factory=dict)
    finals: list[dict[str, Any]] = field(default_factory=list)


def store(rec: HostRecord, ranks: dict[str, Any], *, source: str) -> None:
    """Keep a host's summaries in its record. `complete`: taken after the host had ended,
    so no later record can exist."""
    rec.detail[SUMMARY_KEY] = {"ranks": ranks, "at": time.time(), "source": source,
                               "complete": rec.state in END_STATES}


def needs_summary(rec: HostRecord) -> bool:
    """Whether `status` must ask for this host's metrics beyond what `refresh` brought."""
    if not rec.detail.get("metrics"):
        return False  # a role without metrics files
    kept = rec.detail.get(SUMMARY_KEY)
    if not isinstance(kept, dict):
        return True
    if rec.state in END_STATES:
        return not kept.get("complete")
    return kept.get("source") == TAIL  # an old agent: its summary is only as new as our read


def read_summaries(transport: Transport, rec: HostRecord) -> dict[str, Any]:
    """rank -> summary of each metrics file of a host, from the files' tails (bounded reads);
    a live file shorter than what a summary reads is read after the end of its newest rotated
    file (`config.rotation`), so that a rotation just now loses no newest value."""
    sources = metric_sources(rec)
    older = {path: rotated(path, 1) for path in sources.values()}
    sizes = file_sizes(transport, [*sources.values(), *older.values()])
    out = {}
    for rank, path in sources.items():
        size = sizes.get(path)
        if size is None:
            continue
        state = summary.new_state()
        before = sizes.get(older[path])
        if before and size < summary.SCAN_BYTES:
            state = summary.carry(summary.update(state, _reader(transport, older[path]), before))
        state = summary.update(state, _reader(transport, path), size)
        out[rank] = summary.public(state, rec.detail["metrics"][rank])
    return out


def _reader(transport: Transport, path: str) -> summary.Reader:
    def read(offset: int, length: int) -> bytes:
        parts, end = [], offset + length
        while offset < end:
            data, after = transport.read_tail(path, offset, end - offset)
            if not data or after - len(data) != offset:
                break
            parts.append(data)
            offset = after
        return b"".join(parts)

    return read


def _ts(entry: dict[str, Any]) -> float:
    ts = (entry.get("latest") or {}).get("ts")
    return float(ts) if isinstance(ts, (int, float)) else 0.0


def view(hosts: list[HostRecord]) -> MetricsView:
    """The hosts' kept summaries merged per cluster, newer ranks' values over older ones."""
    entries = []
    for rec in hosts:
        kept = rec.detail.get(SUMMARY_KEY)
        ranks = kept.get("ranks") if isinstance(kept, dict) else None
        for entry in (ranks or {}).values():
            if isinstance(entry, dict):
                entries.append((rec, entry))
    out = MetricsView()
    for rec, entry in sorted(entries, key=lambda e: _ts(e[1])):
        latest = entry.get("latest") or {}
        if rec.role == plan_model.RELAY:
            out.relay.setdefault(rec.cluster, {}).update(latest)
            continue
        if latest:
            out.latest.setdefault(rec.cluster, {}).update(latest)
        if isinstance(entry.get("final"), dict):
            out.finals.append({"cluster": rec.cluster, "host": rec.host, **entry["final"]})
    return out
