"""Every metric record of a job, fetched whole from its hosts (for `nebula report`).

Each agent's metrics files (workers' ranks, the relay) are read from the start in chunks over
the host's transport, parsed, and kept as a local copy under
``$NEBULA_HOME/jobs/<id>/metrics/<cluster>/<host>/<role>-<name>.jsonl``: a host that is gone
later still has its records in the next report. A host that cannot be reached is named and
its last local copy used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.follow import metric_sources, parse_metric
from nebula_cli.control.jobs import JobOps
from nebula_cli.control.state import HostRecord

CHUNK = 4 << 20


@dataclass
class JobRecords:
    job_id: str
    records: list[dict[str, Any]] = field(default_factory=list)
    """Every record, each with ``role`` ("worker"/"relay") added, in file order."""
    unreachable: dict[str, str] = field(default_factory=dict)
    """cluster/host -> why its records are the local copy (or missing)."""

    def workers(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("role") == "worker"]


def _read_whole(ops: JobOps, rec: HostRecord, path: str) -> bytes:
    transport = ops.transport_of(rec)
    chunks, offset = [], 0
    while True:
        chunk, offset = transport.read_tail(path, offset, CHUNK)
        chunks.append(chunk)
        if len(chunk) < CHUNK:
            return b"".join(chunks)


def fetch_records(ops: JobOps, job_id: str) -> JobRecords:
    """The job's records from every host, in parallel; local copies kept and used as needed."""
    job = ops.store.get_job(job_id)
    out = JobRecords(job.id)
    base = ops.store.job_dir(job.id) / "metrics"
    files = [(rec, name, path, base / rec.cluster / rec.host / f"{rec.role}-{name}.jsonl")
             for rec in ops.store.hosts(job.id) for name, path in metric_sources(rec).items()]

    def fetch(i: int) -> bytes:
        rec, _, path, _ = files[i]
        return _read_whole(ops, rec, path)

    try:
        got = fanout(list(range(len(files))), fetch, timeout=300, cancel=ops.abort)
    except GroupError as exc:
        got = {k: v for k, v in exc.results.items() if isinstance(v, bytes)}
        for k, err in exc.failures.items():
            rec = files[k][0]  # type: ignore[index]
            out.unreachable[f"{rec.cluster}/{rec.host}"] = str(err)
    for i, (rec, _, _, local) in enumerate(files):
        data = got.get(i)
        if data:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
        elif local.is_file():
            data = local.read_bytes()
        for line in (data or b"").decode(errors="replace").splitlines():
            if (m := parse_metric(line)) is not None:
                out.records.append({**m, "role": rec.role,
                                    "cluster": m.get("cluster", rec.cluster)})
    return out

