"""A `teacher: {model:}` read before launch: a relative directory in the workdir, an absolute one
on the teacher's first host; not there, or a vocabulary or context other than the students'
(`distill.vocab`, `distill.context`), is said by `validate` and refused by `launch` before any
host is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers.jobs import CLI

from nebula_cli.config.spec import ClusterSpec, JobSpec, parse_spec
from nebula_cli.control.teacher_model import (
    TeacherModel,
    model_problems,
    read_config,
    teacher_models,
)
from nebula_cli.errors import TransportError


def spec_of(work: Path, distill: dict[str, object] | None = None,
            teacher: dict[str, object] | None = None, **top: object) -> JobSpec:
    data = {"name": "d", "workdir": str(work), "run": "python train.py", "relay": {},
            "distill": distill or {},
            "clusters": [{"name": "lab", "transport": "local", "hosts": ["t1"],
                          "role": "teacher", "teacher": teacher or {"model": "distill/teacher"}},
                         {"name": "cloud", "transport": "local", "hosts": ["s1"]}], **top}
    return parse_spec(yaml.safe_dump(data), base_dir=work)


def save_config(folder: Path, **config: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_relative_model_is_read_in_the_workdir(tmp_path: Path) -> None:
    here = f"{tmp_path / 'distill' / 'teacher'} on this machine"
    missing = teacher_models(spec_of(tmp_path))
    assert missing == [TeacherModel("lab", "distill/teacher", here,
                                    missing="no config.json (not a Hugging Face model directory)")]
    assert model_problems(spec_of(tmp_path), missing) == ([
        f"lab: teacher model distill/teacher at {here}: no config.json (not a Hugging Face "
        "model directory); save one there with model.save_pretrained(...), or set "
        "`teacher: {hub: true}` if distill/teacher is a Hugging Face hub id"], [])
    save_config(tmp_path / "distill" / "teacher", vocab_size=2048, n_positions=64)
    [found] = teacher_models(spec_of(tmp_path))
    assert (found.vocab, found.positions, found.missing) == (2048, 64, None)
    assert found.said() == f"lab: teacher model distill/teacher at {here}: vocabulary 2,048, " \
                           "64 positions"
    assert model_problems(spec_of(tmp_path), [found]) == ([], [])


def test_a_model_the_jobs_setup_may_make_is_a_note_and_a_path_no_hub_hint(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, teacher={"model": "./models/t"},
                   setup="huggingface-cli download org/t --local-dir models/t")
    problems, [note] = model_problems(spec, teacher_models(spec))
    assert problems == [] and note.endswith("(unless the job's `setup:` makes it on the hosts)")
    assert "hub: true" not in note  # ./models/t is no hub id


@pytest.mark.parametrize("distill, says", [
    ({"vocab": 50257}, "lab: teacher model distill/teacher has a vocabulary of 2,048 (its "
                       "config's vocab_size) and the students' models 50,257 (distill.vocab): a "
                       "student learns only from a teacher with its own tokenizer and "
                       "vocabulary"),
    ({"context": 128}, "lab: teacher model distill/teacher runs 64 positions and the students' "
                       "sequences (distill.context) are 128: give the students shorter "
                       "sequences or the teacher a longer context"),
    ({"vocab": 2048, "context": 64}, None),
])
def test_the_students_declared_vocabulary_and_context_meet_the_teachers(
        tmp_path: Path, distill: dict[str, object], says: str | None) -> None:
    save_config(tmp_path / "distill" / "teacher", vocab_size=2048, max_position_embeddings=64)
    spec = spec_of(tmp_path, distill)
    assert model_problems(spec, teacher_models(spec)) == ([] if says is None else [says], [])


@pytest.mark.parametrize("teacher, top, why", [
    ({"model": "org/name", "hub": True}, {}, "a Hugging Face hub id, downloaded by its hosts"),
    ({"model": "distill/teacher"}, {"exclude": ["distill"]}, "left out of the upload by"),
    ({"model": "./distill/teacher"}, {"exclude": ["distill/*"]}, "left out of the upload by"),
    ({"model": "distill/teacher"}, {"exclude": ["*.json"]}, "left out of the upload by"),
    ({"model": "../elsewhere"}, {}, "outside the workdir"),
    ({"model": "~/models/t"}, {}, "a path in a home on the teacher's hosts"),
    ({"model": "/models/t"}, {}, "on t1: `validate --hosts` reads it there"),
])
def test_what_cannot_be_read_before_launch_is_said_not_refused(
        tmp_path: Path, teacher: dict[str, object], top: dict[str, object], why: str) -> None:
    spec = spec_of(tmp_path, teacher=teacher, **top)
    [m] = teacher_models(spec)
    assert not m.read and why in m.said(), m.said()
    assert model_problems(spec, [m]) == ([], [])


def test_an_absolute_model_is_read_on_the_teachers_first_host(tmp_path: Path) -> None:
    absolute = spec_of(tmp_path, teacher={"model": "/models/t"})
    asked: list[tuple[str, str]] = []

    def read(cluster: ClusterSpec, path: str) -> bytes | None:
        asked.append((cluster.name, path))
        return json.dumps({"vocab_size": 7, "text_config": {"n_ctx": 9}}).encode()

    [found] = teacher_models(absolute, read)
    assert asked == [("lab", "/models/t/config.json")]
    assert (found.where, found.vocab, found.positions) == ("/models/t on t1", 7, 9)

    def fails(cluster: ClusterSpec, path: str) -> bytes | None:
        raise TransportError("t1: connection refused")

    [unread] = teacher_models(absolute, fails)
    assert unread.missing == "could not read it: t1: connection refused"


def test_a_config_that_is_not_json_or_holds_nulls_is_said() -> None:
    assert read_config(b"{")[2].startswith("config.json is not JSON")
    assert read_config(b"[1]") == (None, None, "config.json holds no mapping")
    assert read_config(b'{"text_config": null, "vocab_size": 5}') == (5, None, None)


def test_validate_says_it_and_launch_refuses_before_touching_a_host(
        cli: CLI, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "d", "workdir": str(work), "run": "python train.py", "relay": {},
        "distill": {"vocab": 512},
        "clusters": [{"name": "lab", "transport": "local", "hosts": ["t1"], "role": "teacher",
                      "teacher": {"model": "teacher"}},
                     {"name": "cloud", "transport": "local", "hosts": ["s1"]}]}))
    missing = f"lab: teacher model teacher at {work / 'teacher'} on this machine: no config.json"
    said = cli("validate", str(spec))
    assert said.returncode == 1
    assert missing in " ".join(said.stderr.split())
    launched = cli("launch", str(spec))
    assert launched.returncode == 1 and cli.job_ids() == []  # nothing started, nothing recorded
    assert missing in " ".join(launched.stderr.split())
    save_config(work / "teacher", vocab_size=300, n_positions=32)
    said = cli("validate", str(spec))
    assert said.returncode == 1, said.stdout
    assert "vocabulary 300, 32 positions" in said.stdout
    assert "teacher model teacher has a vocabulary of 300 (its config's vocab_size) and the " \
           "students' models 512 (distill.vocab)" in " ".join(said.stderr.split())


def test_validate_hosts_reads_an_absolute_model_on_the_teachers_host(
        cli: CLI, tmp_path: Path) -> None:
    """The local transport's host is this machine: the read goes through the transport as on
    an SSH host (Orchestrator.read_on_gateway)."""
    save_config(tmp_path / "models" / "t", vocab_size=300, n_positions=32)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "d", "workdir": str(tmp_path), "run": "python train.py", "relay": {},
        "distill": {"context": 64},
        "clusters": [{"name": "lab", "transport": "local", "hosts": ["t1"], "role": "teacher",
                      "teacher": {"model": str(tmp_path / "models" / "t")}},
                     {"name": "cloud", "transport": "local", "hosts": ["s1"]}]}))
    plain = cli("validate", str(spec))
    assert plain.returncode == 0, plain.stderr  # not read without --hosts
    said = cli("validate", str(spec), "--hosts", timeout=180)
    text = " ".join((said.stdout + said.stderr).split())
    assert f"teacher model {tmp_path / 'models' / 't'} at {tmp_path / 'models' / 't'} on t1: " \
           "vocabulary 300, 32 positions" in text, text
    assert "runs 32 positions and the students' sequences (distill.context) are 64" in text
    assert said.returncode == 1
