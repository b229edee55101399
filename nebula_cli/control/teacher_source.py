"""`teacher: {from_job: JOB}`: the earlier job's newest complete checkpoint, found on the first
host of its cluster (`from_cluster`, default its first training cluster), copied to each of
the teacher's hosts at launch, into ``<job dir>/teacher-checkpoint`` (the folder
``NEBULA_TEACHER_CHECKPOINT`` names to the teacher's `run`).

It travels through this machine: each file is downloaded once into nebula's local cache
(``<nebula home>/teacher-checkpoints/<job>/<cluster>/<tag>``, a file at a time, each first as a
``.part`` renamed when whole: a copy cut off goes on at the next launch from the files it
had), then uploaded to every teacher host, its files 0600 in folders 0700 and the COMPLETE
marker last, as nebula publishes a checkpoint (the teacher's loader trusts nothing else). The
size is said before the copy starts. Where hosts share files with this machine (the local
transport) the cache is still the one copy read from.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_cli.config import checkpoint_paths, plan_model
from nebula_cli.config.distill_config import TEACHER_CHECKPOINT_DIR
from nebula_cli.config.parts import CHECKPOINT_MARKER as MARKER
from nebula_cli.config.parts import CHECKPOINT_TAG_PREFIX as TAG_PREFIX
from nebula_cli.config.parts import checkpoint_tag as tag_of
from nebula_cli.config.spec import ClusterSpec, JobSpec, spec_of_record
from nebula_cli.control.planning import describe_host
from nebula_cli.control.state import StateStore
from nebula_cli.errors import NebulaError, SpecError, UsageError
from nebula_cli.transport import Conn, Transport

Progress = Callable[[str], None]
GetTransport = Callable[[Conn], Transport]

CACHE_DIR = "teacher-checkpoints"
"""Under nebula's home on this machine: the checkpoints `from_job` downloaded."""
RECORD = "teacher-sources.json"
"""In the job's local folder: each `from_job` teacher's checkpoint as launch resolved it (a
resume serves the same one, not the newest of a job of that name run since)."""

LIST_TAG = r"""
import json, os, sys
root, prefix, marker, pinned = sys.argv[1:5]
steps = []
for name in os.listdir(root) if os.path.isdir(root) else []:
    digits = name[len(prefix):]
    if name.startswith(prefix) and digits.isdigit() and os.path.isfile(
            os.path.join(root, name, marker)):
        steps.append(int(digits))
if pinned:
    steps = [s for s in steps if s == int(pinned)]
out = {"steps": sorted(steps), "files": []}
if steps:
    tag = os.path.join(root, prefix + str(max(steps)))
    for d, _, names in os.walk(tag):
        for n in names:
            p = os.path.join(d, n)
            out["files"].append([os.path.relpath(p, tag), os.path.getsize(p)])
print(json.dumps(out))
"""
"""Run with the host's python: the newest complete tag of a checkpoint folder (or the one of the
step given), and its files with their sizes."""


@dataclass(frozen=True)
class CheckpointSource:
    """The checkpoint a `from_job` teacher serves: where it is and what it holds."""

    job_id: str
    cluster: str
    host: str
    folder: str
    """The earlier job's checkpoint folder on ``host``."""
    step: int
    files: tuple[tuple[str, int], ...]
    """(path in the tag, bytes), the COMPLETE marker among them."""
    conn: Conn | None = None
    """How this machine reaches ``host`` (None: read back from the job's record, not asked)."""

    @property
    def tag(self) -> str:
        return tag_of(self.step)

    @property
    def size(self) -> int:
        return sum(n for _, n in self.files)

    def cached_at(self, cache: Path) -> Path:
        """Where the tag lies in the local cache under ``cache``."""
        return cache / CACHE_DIR / self.job_id / self.cluster / self.tag

    def to_record(self) -> dict[str, Any]:
        """What the job's record keeps (`RECORD`): a resume serves the same checkpoint."""
        return {"job_id": self.job_id, "cluster": self.cluster, "host": self.host,
                "folder": self.folder, "step": self.step, "files": [list(f) for f in self.files]}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> CheckpointSource:
        return cls(str(data["job_id"]), str(data["cluster"]), str(data["host"]),
                   str(data["folder"]), int(data["step"]),
                   tuple((str(p), int(n)) for p, n in data["files"]))

    def said(self) -> str:
        return (f"job {self.job_id}'s checkpoint {self.tag} of cluster {self.cluster} "
                f"({_size(self.size)}, {len(self.files)} files, on {self.host})")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def source_cluster(spec: JobSpec, job_id: str, named: str | None) -> ClusterSpec:
    """The earlier job's cluster whose checkpoint is served: ``named``, or its first training
    cluster; UsageError naming the fix when the job has no such cluster or no checkpoints."""
    if spec.checkpoint is None:
        raise UsageError(f"job {job_id} saved no checkpoints (its spec has no `checkpoint:`): "
                         "it has nothing a teacher could serve; run it with `checkpoint:`")
    training = [c for c in spec.clusters if not c.kind.serves_labels]
    if named is None:
        if not training:
            raise UsageError(f"job {job_id} has no training cluster")
        chosen = training[0]
    else:
        found = [c for c in training if c.name == named]
        if not found:
            raise UsageError(f"job {job_id} has no training cluster {named!r} "
                             f"(teacher.from_cluster): its training clusters are "
                             f"{', '.join(c.name for c in training)}")
        chosen = found[0]
    try:
        ds = spec.deepspeed_config() or {}
    except SpecError:  # its config file is gone from this machine: the stage is not known
        ds = {}
    zero = (ds.get("zero_optimization") or {}).get("stage", 0)
    nodes = chosen.scheduling.node_count(chosen)
    if zero and nodes > 1:
        raise UsageError(f"job {job_id}'s cluster {chosen.name} ran ZeRO {zero} on {nodes} "
                         "hosts: each host's checkpoint holds only its own ranks' partitions, "
                         "and a teacher is served from one host's (not yet joined across "
                         "hosts); take a cluster of one host (teacher.from_cluster)")
    return chosen


def find_source(store: StateStore, transport: GetTransport, ref: str,
                cluster: str | None, step: int | None = None) -> CheckpointSource:
    """The newest complete checkpoint of job ``ref``'s cluster (``step``: that step's), on its
    first host."""
    job = store.get_job(ref)
    spec = spec_of_record(job.spec, job.spec_path)
    c = source_cluster(spec, job.id, cluster)
    host = c.hosts[0]
    conn = describe_host(c, host, str(store.home))
    t = transport(conn)
    place = c.scheduling.checkpoint_places(c, host)[0]
    folder = checkpoint_paths.checkpoint_dir(spec, job.id, plan_model.job_root_in(t.home, job.id),
                                             c, place)
    assert folder is not None  # (the spec has `checkpoint:`)
    found = t.run([t.python, "-c", LIST_TAG, folder, TAG_PREFIX, MARKER,
                   "" if step is None else str(step)], timeout=120)
    if not found.ok:
        raise UsageError(f"could not list job {job.id}'s checkpoints in {folder} on "
                         f"{host.host}: {found.tail()}")
    listed = json.loads(found.stdout.strip().splitlines()[-1])
    if not listed["steps"]:
        which = "no complete checkpoint" if step is None else f"no complete checkpoint {step}"
        raise UsageError(f"job {job.id} has {which} in {folder} on {host.host} (cluster "
                         f"{c.name}): it saved none, or they were removed")
    return CheckpointSource(job.id, c.name, host.host, folder, max(listed["steps"]),
                            tuple((str(p), int(n)) for p, n in sorted(listed["files"])), conn)


def record(job_dir: Path, sources: dict[str, CheckpointSource]) -> None:
    """Keep each teacher cluster's checkpoint as launch resolved it (`RECORD`)."""
    (job_dir / RECORD).write_text(json.dumps({n: s.to_record() for n, s in sources.items()},
                                             indent=1))


def recorded(job_dir: Path) -> dict[str, CheckpointSource]:
    """What `record` kept; {} when there is none."""
    try:
        data = json.loads((job_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {name: CheckpointSource.from_record(s) for name, s in data.items()}


def cached(source: CheckpointSource, cache: Path) -> Path | None:
    """The tag in the local cache under ``cache`` when every file of it is there whole."""
    local = source.cached_at(cache)
    return local if all(_whole(local / p, n) for p, n in source.files) else None


def fetch(source: CheckpointSource, t: Transport, cache: Path, progress: Progress) -> Path:
    """The checkpoint's tag in the local cache under ``cache``, each file downloaded unless a
    whole one is there (a copy cut off goes on from there)."""
    local = source.cached_at(cache)
    have = sum(n for p, n in source.files if _whole(local / p, n))
    if have < source.size:
        progress(f"copying {source.said()}"
                 + (f": {_size(have)} of it already here" if have else ""))
    for path, size in source.files:
        dest = local / path
        if _whole(dest, size):
            continue
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        part = dest.with_name(dest.name + ".part")
        t.get(posixpath.join(source.folder, source.tag, path), str(part))
        got = part.stat().st_size
        if got != size:
            raise UsageError(f"{path} of {source.said()} came as {got} bytes, not {size}: "
                             "it changed while it was copied; launch again")
        os.replace(part, dest)
    return local


def _whole(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def place(source: CheckpointSource, local: Path, t: Transport, job_root: str,
          where: str, progress: Progress) -> str:
    """The tag uploaded into ``<job_root>/teacher-checkpoint`` on a teacher's host, published
    as nebula publishes checkpoints (private files, the marker last); the folder's path."""
    folder = posixpath.join(job_root, TEACHER_CHECKPOINT_DIR)
    tag = posixpath.join(folder, source.tag)
    if t.exists(posixpath.join(tag, MARKER)):  # placed already (a resume, or a host sharing
        return folder                          # this folder: published whole, marker last)
    t.makedirs(folder, mode=0o700)
    for path, _ in sorted(source.files, key=lambda f: f[0] == MARKER):  # the marker last
        remote = posixpath.join(tag, path)
        t.makedirs(posixpath.dirname(remote), mode=0o700)
        t.put(str(local / path), remote, mode=0o600)
    progress(f"{where}: teacher checkpoint {source.tag} of job {source.job_id} placed "
             f"({_size(source.size)})")
    return folder


def sourced_teachers(spec: JobSpec) -> list[ClusterSpec]:
    """The spec's teacher clusters that serve an earlier job's checkpoint."""
    return [c for c in spec.clusters if c.teacher is not None and c.teacher.from_job]


def source_problems(store: StateStore, spec: JobSpec) -> tuple[list[str], list[str]]:
    """(problems, notes) of each `teacher: {from_job:}`, from this machine's records alone
    (before launch touches a host): the job there, with `checkpoint:` and the cluster named;
    the note says what launch will copy from where."""
    problems, notes = [], []
    for c in sourced_teachers(spec):
        assert c.teacher is not None and c.teacher.from_job is not None
        try:
            job = store.get_job(c.teacher.from_job)
            held = source_cluster(spec_of_record(job.spec, job.spec_path), job.id,
                                  c.teacher.from_cluster)
        except UsageError as exc:
            problems.append(f"{c.name}: teacher.from_job: {exc}")
            continue
        notes.append(f"{c.name}: serves job {job.id}'s newest complete checkpoint of cluster "
                     f"{held.name} ({job.state}), copied from {held.hosts[0].host} at launch")
    return problems, notes


def find_sources(store: StateStore, transport: GetTransport, spec: JobSpec
                 ) -> tuple[list[str], list[str]]:
    """(what was found, problems) of each `teacher: {from_job:}`, asked of the earlier job's
    host (`validate --hosts`): the checkpoint a launch would copy, with its size."""
    found, problems = [], []
    for c in sourced_teachers(spec):
        assert c.teacher is not None and c.teacher.from_job is not None
        try:
            source = find_source(store, transport, c.teacher.from_job, c.teacher.from_cluster)
        except NebulaError as exc:
            problems.append(f"{c.name}: teacher.from_job: {exc}")
            continue
        found.append(f"{c.name}: would serve {source.said()}")
    return found, problems
