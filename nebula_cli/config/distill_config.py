"""`DistillConfig` (`distill.json`): what a teacher's or a student's processes need to serve or
receive soft labels (spec: `distill:`, a cluster's `role:`).

Standard library only; no field has a default: the plan fills every value from the spec
(`config.distill_plan`), where the defaults live (`config.distill_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nebula_cli.config import strict
from nebula_cli.config.relay_config import TlsFiles

DISTILL_CONFIG_ENV = "NEBULA_DISTILL_CONFIG"
"""The environment variable that names a process's distill.json."""
TEACHER_CHECKPOINT_ENV = "NEBULA_TEACHER_CHECKPOINT"
"""The environment variable that names, to a teacher's `run`, the checkpoint folder it serves
(`teacher: {from_job:}` or `{checkpoint:}`)."""
TEACHER_CHECKPOINT_DIR = "teacher-checkpoint"
"""Where in the job's folder on a teacher's host `from_job`'s checkpoint is copied."""


@dataclass(frozen=True)
class DistillConfig:
    """One cluster's view of the job's distillation."""

    job_id: str
    cluster: str
    teacher: bool
    """Whether this cluster serves soft labels (role: teacher) or learns from them."""
    listen: str
    """A teacher: host:port its label relay binds (empty for a student)."""
    teachers: dict[str, str]
    """The teacher clusters' label relays by cluster name: host:port (a student dials them in
    this order, the next one when one is gone)."""
    students: dict[str, int]
    """The clusters whose certificates a teacher answers, and their slots in the plan (a
    student cluster holds at most that many links to a label relay, plus one)."""
    tls: TlsFiles
    topk: int
    temperature: float
    alpha: float
    lookahead: int
    when_no_teacher: str
    """"wait" or "ce_only"."""
    values: str
    """How labels cross the wire (`relay.distill.sparse.Values`): "fp16" or "int8" (a top k
    and its values), "draws" (`labels: sampled`: k drawn ids, no values), or "token"
    (`mode: on_policy`: the teacher's log-probability of each asked token, no ids)."""
    max_tokens: int
    vocab: int | None
    """The students' vocabulary as the spec declares it (`distill.vocab`; None: not declared):
    a teacher whose answers say another is refused at the first."""
    wait_s: float
    dead_after: float
    """Seconds of silence after which a teacher's link is taken for dead (relay.dead_after)."""
    model: str | None
    """A teacher with the built-in server: its Hugging Face model directory (or hub id)."""
    hub: bool
    """Whether `model` is a Hugging Face hub id (otherwise a directory: never looked up on the
    hub)."""
    batch_tokens: int | None

    @classmethod
    def load(cls, path: str | Path) -> DistillConfig:
        return strict.load(cls, path)
