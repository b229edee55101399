"""What `validate` learns of each `teacher: {model: ...}` before launch: whether the directory
holds a Hugging Face model (its config.json) and, from that config, its vocabulary and
positions, set against the students' `distill.vocab` and `distill.context` where the spec
declares them.

A relative `model` is read in the launching machine's workdir (what the teacher's hosts get);
an absolute one on the teacher cluster's first host, when `validate --hosts` reaches it. A hub
id (`teacher.hub: true`) is not looked up.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nebula_cli.config.spec import ClusterSpec, JobSpec

CONFIG = "config.json"
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
"""The config keys of a model's positions, as Hugging Face's model families name them."""

ReadRemote = Callable[[ClusterSpec, str], bytes | None]
"""Reads a file on a cluster's first host (None: not there)."""


@dataclass(frozen=True)
class TeacherModel:
    """One teacher cluster's model as read before launch."""

    cluster: str
    model: str
    where: str
    """Where it was read: "the workdir" or the host."""
    vocab: int | None = None
    positions: int | None = None
    missing: str | None = None
    """Why no model was found there (None: its config was read)."""

    def said(self) -> str:
        if self.missing is not None:
            return f"{self.cluster}: teacher model {self.model} in {self.where}: {self.missing}"
        return (f"{self.cluster}: teacher model {self.model} in {self.where}: vocabulary "
                f"{_num(self.vocab)}, {_num(self.positions)} positions")


def _num(n: int | None) -> str:
    return "unknown" if n is None else f"{n:,}"


def read_config(data: bytes | None) -> tuple[int | None, int | None, str | None]:
    """(vocabulary, positions, why not) of a config.json's bytes."""
    if data is None:
        return None, None, f"no {CONFIG} (not a Hugging Face model directory)"
    try:
        config = json.loads(data)
    except ValueError as exc:
        return None, None, f"{CONFIG} is not JSON ({exc})"
    if not isinstance(config, dict):
        return None, None, f"{CONFIG} holds no mapping"
    config = config.get("text_config", config) if "vocab_size" not in config else config
    vocab = config.get("vocab_size")
    positions = next((config[k] for k in POSITION_KEYS if isinstance(config.get(k), int)),
                     None)
    return vocab if isinstance(vocab, int) else None, positions, None


def teacher_models(spec: JobSpec, read_remote: ReadRemote | None = None) -> list[TeacherModel]:
    """Every `teacher: {model:}` that can be read now: relative ones in the workdir (unless
    `exclude` leaves them out of the upload), absolute ones through ``read_remote``."""
    found = []
    for c in spec.clusters:
        if c.teacher is None or c.teacher.hub:
            continue
        model = c.teacher.model
        if model.startswith("~"):
            continue  # a home on the host: not known before launch
        if posixpath.isabs(model):
            if read_remote is None:
                continue
            where = c.gateway_host.host
            data = read_remote(c, posixpath.join(model, CONFIG))
        else:
            if any(fnmatch.fnmatch(model, p) or fnmatch.fnmatch(model + "/", p)
                   for p in spec.exclude):
                continue  # not uploaded: it is put on the hosts some other way
            path = Path(spec.workdir) / model / CONFIG
            where = "the workdir"
            data = path.read_bytes() if path.is_file() else None
        vocab, positions, missing = read_config(data)
        found.append(TeacherModel(c.name, model, where, vocab, positions, missing))
    return found


def model_problems(spec: JobSpec, models: list[TeacherModel]) -> list[str]:
    """One line per teacher model that is not there, or whose vocabulary or positions do not
    match what the spec declares of the students, with the fix."""
    d = spec.distill
    problems = []
    for m in models:
        if m.missing is not None:
            problems.append(
                f"{m.said()}; save one there with model.save_pretrained(...), or set "
                f"`teacher: {{hub: true}}` if {m.model} is a Hugging Face hub id")
            continue
        if d is None:
            continue
        if d.vocab is not None and m.vocab is not None and m.vocab != d.vocab:
            problems.append(
                f"{m.cluster}: teacher model {m.model} has a vocabulary of {m.vocab:,} tokens and "
                f"the students' (distill.vocab) is {d.vocab:,}: a student learns only from a "
                "teacher with its own tokenizer")
        if d.context is not None and m.positions is not None and m.positions < d.context:
            problems.append(
                f"{m.cluster}: teacher model {m.model} runs {m.positions:,} positions and the "
                f"students' sequences (distill.context) are {d.context:,}: give the students "
                "shorter sequences or the teacher a longer context")
    return problems
