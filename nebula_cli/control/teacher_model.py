"""What `validate` learns of each `teacher: {model: ...}` before launch: whether the directory
holds a Hugging Face model (its config.json) and, from that config, its vocabulary and
positions, set against the students' `distill.vocab` and `distill.context` where the spec
declares them.

A relative `model` inside the workdir is read on the launching machine (what the teacher's
hosts get, unless `exclude` leaves it out of the upload); an absolute one on the teacher
cluster's first host, when `validate --hosts` reaches it. Not read, and said so: a hub id
(`teacher.hub: true`), a `~` path, one outside the workdir or excluded from the upload, an
absolute one without `--hosts`. A job with `setup:` may make the model on its hosts: a model
missing here is then a note, not an error.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nebula_cli.config.hf_model import positions_of, vocab_of
from nebula_cli.config.spec import ClusterSpec, JobSpec
from nebula_cli.errors import NebulaError
from nebula_cli.transport.tree import excluded

CONFIG = "config.json"

ReadRemote = Callable[[ClusterSpec, str], bytes | None]
"""Reads a file on a cluster's first host (None: not there; NebulaError: could not read)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class TeacherModel:
    """One teacher cluster's model as seen before launch."""

    cluster: str
    model: str
    where: str
    """Where it was read ("<path> on this machine", or the host), or why it was not."""
    vocab: int | None = None
    positions: int | None = None
    missing: str | None = None
    """Why no model was found there (None: its config was read, or it was not read)."""
    read: bool = True
    """False: not checkable before launch (`where` says why)."""

    def said(self) -> str:
        head = f"{self.cluster}: teacher model {self.model}"
        if not self.read:
            return f"{head}: not read before launch ({self.where})"
        if self.missing is not None:
            return f"{head} at {self.where}: {self.missing}"
        return (f"{head} at {self.where}: vocabulary {_num(self.vocab)}, "
                f"{_num(self.positions)} positions")


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
    return vocab_of(config), positions_of(config), None


def _unread(c: ClusterSpec, why: str) -> TeacherModel:
    assert c.teacher is not None and c.teacher.model is not None
    return TeacherModel(c.name, c.teacher.model, why, read=False)


def _model_of(spec: JobSpec, c: ClusterSpec, read_remote: ReadRemote | None) -> TeacherModel:
    assert c.teacher is not None and c.teacher.model is not None
    model = c.teacher.model
    if c.teacher.hub:
        return _unread(c, "a Hugging Face hub id, downloaded by its hosts")
    if model.startswith("~"):
        return _unread(c, "a path in a home on the teacher's hosts")
    if posixpath.isabs(model):
        if read_remote is None:
            return _unread(c, f"on {c.gateway_host.host}: `validate --hosts` reads it there")
        where = f"{model} on {c.gateway_host.host}"
        try:
            data = read_remote(c, posixpath.join(model, CONFIG))
        except NebulaError as exc:
            return TeacherModel(c.name, model, where, missing=f"could not read it: {exc}")
    else:
        rel = posixpath.normpath(model)
        if rel == ".." or rel.startswith("../"):
            return _unread(c, "outside the workdir, which is all the teacher's hosts get")
        if excluded(rel, spec.exclude) or excluded(posixpath.join(rel, CONFIG), spec.exclude):
            return _unread(c, "left out of the upload by `exclude`")
        path = Path(spec.workdir) / rel
        where = f"{path} on this machine"
        file = path / CONFIG
        data = file.read_bytes() if file.is_file() else None
    vocab, positions, missing = read_config(data)
    return TeacherModel(c.name, model, where, vocab, positions, missing)


def teacher_models(spec: JobSpec, read_remote: ReadRemote | None = None) -> list[TeacherModel]:
    """Every teacher cluster's `teacher: {model:}`, read where it can be now (module doc)."""
    return [_model_of(spec, c, read_remote) for c in spec.clusters
            if c.teacher is not None and c.teacher.builtin]


def model_problems(spec: JobSpec, models: list[TeacherModel]) -> tuple[list[str], list[str]]:
    """(problems, notes): a teacher model that is not there (a note where `setup:` may make
    it), or whose vocabulary or positions do not match what the spec declares of the
    students, each with the fix."""
    d = spec.distill
    problems, notes = [], []
    for m in models:
        if m.missing is not None:
            hub = (f", or set `teacher: {{hub: true}}` if {m.model} is a Hugging Face hub id"
                   if _HUB_ID.fullmatch(m.model) else "")
            said = f"{m.said()}; save one there with model.save_pretrained(...){hub}"
            if spec.setup is not None:
                notes.append(f"{said} (unless the job's `setup:` makes it on the hosts)")
            else:
                problems.append(said)
            continue
        if d is None or not m.read:
            continue
        if d.vocab is not None and m.vocab is not None and m.vocab != d.vocab:
            problems.append(
                f"{m.cluster}: teacher model {m.model} has a vocabulary of {m.vocab:,} (its "
                f"config's vocab_size) and the students' models {d.vocab:,} (distill.vocab): "
                "a student learns only from a teacher with its own tokenizer and vocabulary")
        if d.context is not None and m.positions is not None and m.positions < d.context:
            problems.append(
                f"{m.cluster}: teacher model {m.model} runs {m.positions:,} positions and the "
                f"students' sequences (distill.context) are {d.context:,}: give the students "
                "shorter sequences or the teacher a longer context")
    return problems, notes
