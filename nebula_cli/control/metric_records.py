"""Every metric record of a job, fetched whole from its hosts (for `nebula report`), and the
TensorBoard runs its workers wrote (for `report` and `logs`).

Each agent's metrics files (workers' ranks, the relay) are read from the start in chunks over
the host's transport (the rotated ones first, oldest first: `config.rotation`), parsed, and
kept as a local copy under ``$NEBULA_HOME/jobs/<id>/metrics/<cluster>/<host>/<role>-<name>.jsonl``:
a host that is gone later still has its records in the next report. A host that cannot be
reached is named and its last local copy used.

With the spec's ``metrics: {tensorboard: true}`` each cluster's first host writes the
cluster's event files (the plan records where, in the host's ``tensorboard``); they are copied
to ``$NEBULA_HOME/jobs/<id>/tb/<cluster>/``, only the bytes not copied yet (event files only
grow).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_cli.config.rotation import paths_oldest_first
from nebula_cli.control.fanout import GroupError, fanout
from nebula_cli.control.follow import metric_sources, parse_metric
from nebula_cli.control.jobs import JobOps
from nebula_cli.control.state import HostRecord
from nebula_cli.errors import NebulaError

CHUNK = 4 << 20
EVENT_FILES = "events.out.tfevents."
"""How TensorBoard's event files are named."""
_LIST_EVENTS = (
    "import json, os, sys\n"
    "d = os.path.expanduser(sys.argv[1])\n"
    "names = sorted(os.listdir(d)) if os.path.isdir(d) else []\n"
    "print(json.dumps({n: os.path.getsize(os.path.join(d, n)) for n in names\n"
    "                  if n.startswith(sys.argv[2])}))\n"
)


@dataclass
class JobRecords:
    job_id: str
    records: list[dict[str, Any]] = field(default_factory=list)
    """Every record, each with ``role`` ("worker"/"relay") added, in file order."""
    unreachable: dict[str, str] = field(default_factory=dict)
    """cluster/host -> why its records are the local copy (or missing)."""

    def workers(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("role") == "worker"]


def _read_whole(ops: JobOps, rec: HostRecord, path: str, offset: int = 0) -> bytes:
    """The file from `offset` to its end."""
    transport = ops.session.transport_of(rec)
    chunks = []
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

    def fetch(i: int) -> bytes:  # the rotated files, oldest first, then the live one
        rec, _, path, _ = files[i]
        return b"".join(_read_whole(ops, rec, p)
                        for p in paths_oldest_first(path, rec.rotated_kept))

    try:
        got = fanout(list(range(len(files))), fetch, timeout=300, cancel=ops.session.abort)
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



@dataclass
class TensorBoardCopy:
    directory: Path
    """$NEBULA_HOME/jobs/<id>/tb: one run per cluster below it."""
    files: int = 0
    """Event files of the job, copied whole."""
    copied: int = 0
    """Bytes copied by this call."""
    unreachable: dict[str, str] = field(default_factory=dict)
    """cluster/host -> why its files are as last copied."""


def tensorboard_hosts(ops: JobOps, job_id: str) -> list[HostRecord]:
    """The workers that write their cluster's TensorBoard run (none: the spec asks for none)."""
    return [r for r in ops.store.hosts(job_id) if r.detail.get("tensorboard")]


def fetch_tensorboard(ops: JobOps, job_id: str) -> TensorBoardCopy:
    """Copy the job's TensorBoard event files from its hosts, in parallel (what is new)."""
    out = TensorBoardCopy(ops.store.job_dir(job_id) / "tb")
    recs = tensorboard_hosts(ops, job_id)

    def fetch(i: int) -> tuple[int, int]:
        rec = recs[i]
        remote, local = rec.detail["tensorboard"], out.directory / rec.cluster
        transport = ops.session.transport_of(rec)
        listed = transport.run([transport.python, "-c", _LIST_EVENTS, remote, EVENT_FILES],
                               timeout=60)
        if not listed.ok:
            raise NebulaError(f"cannot list {remote}: {listed}")
        files, copied = 0, 0
        for name, size in json.loads(listed.stdout).items():
            target = local / posixpath.basename(name)
            have = target.stat().st_size if target.is_file() else 0
            if size > have:
                data = _read_whole(ops, rec, posixpath.join(remote, name), have)
                local.mkdir(parents=True, exist_ok=True)
                with open(target, "ab") as f:
                    f.write(data)
                copied += len(data)
            files += 1
        return files, copied

    try:
        got = fanout(list(range(len(recs))), fetch, timeout=300, cancel=ops.session.abort)
    except GroupError as exc:
        got = {k: v for k, v in exc.results.items() if isinstance(v, tuple)}
        for k, err in exc.failures.items():
            rec = recs[k]  # type: ignore[index]
            out.unreachable[f"{rec.cluster}/{rec.host}"] = str(err)
    for files, copied in got.values():
        out.files += files
        out.copied += copied
    return out
