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
    missing = teacher_models(spec_of(tmp_path))
    assert missing == [TeacherModel("lab", "distill/teacher", "the workdir",
                                    missing="no config.json (not a Hugging Face model directory)")]
    [problem] = model_problems(spec_of(tmp_path), missing)
    assert problem == (
        "lab: teacher model distill/teacher in the workdir: no config.json (not a Hugging Face "
        "model directory); save one there with model.save_pretrained(...), or set "
        "`teacher: {hub: true}` if distill/teacher is a Hugging Face hub id")
    save_config(tmp_path / "distill" / "teacher", vocab_size=2048, n_positions=64)
    [found] = teacher_models(spec_of(tmp_path))
    assert (found.vocab, found.positions, found.missing) == (2048, 64, None)
    assert found.said() == ("lab: teacher model distill/teacher in the workdir: vocabulary "
                            "2,048, 64 positions")
    assert model_problems(spec_of(tmp_path), [found]) == []


@pytest.mark.parametrize("distill, says", [
    ({"vocab": 50257}, "lab: teacher model distill/teacher has a vocabulary of 2,048 tokens and "
                       "the students' (distill.vocab) is 50,257: a student learns only from a "
                       "teacher with its own tokenizer"),
    ({"context": 128}, "lab: teacher model distill/teacher runs 64 positions and the students' "
                       "sequences (distill.context) are 128: give the students shorter "
                       "sequences or the teacher a longer context"),
    ({"vocab": 2048, "context": 64}, None),
])
def test_the_students_declared_vocabulary_and_context_meet_the_teachers(
        tmp_path: Path, distill: dict[str, object], says: str | None) -> None:
    save_config(tmp_path / "distill" / "teacher", vocab_size=2048, max_position_embeddings=64)
    spec = spec_of(tmp_path, distill)
    assert model_problems(spec, teacher_models(spec)) == ([] if says is None else [says])


def test_hub_ids_excluded_folders_and_remote_paths(tmp_path: Path) -> None:
    assert teacher_models(spec_of(tmp_path, teacher={"model": "org/name", "hub": True})) == []
    assert teacher_models(spec_of(tmp_path, exclude=["distill/*"])) == []  # put there otherwise
    absolute = spec_of(tmp_path, teacher={"model": "/models/t"})
    assert teacher_models(absolute) == []  # no host reached: not read
    asked: list[tuple[str, str]] = []

    def read(cluster: ClusterSpec, path: str) -> bytes | None:
        asked.append((cluster.name, path))
        return json.dumps({"text_config": {"vocab_size": 7, "n_ctx": 9}}).encode()

    [found] = teacher_models(absolute, read)
    assert asked == [("lab", "/models/t/config.json")]
    assert (found.where, found.vocab, found.positions) == ("t1", 7, 9)


def test_a_config_that_is_not_json_is_said() -> None:
    assert read_config(b"{")[2].startswith("config.json is not JSON")
    assert read_config(b"[1]") == (None, None, "config.json holds no mapping")


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
    said = cli("validate", str(spec))
    assert said.returncode == 1
    assert "error: lab: teacher model teacher in the workdir: no config.json" in said.stderr
    launched = cli("launch", str(spec))
    assert launched.returncode == 1 and cli.job_ids() == []  # nothing started, nothing recorded
    assert "lab: teacher model teacher in the workdir: no config.json" in launched.stderr
    save_config(work / "teacher", vocab_size=300, n_positions=32)
    said = cli("validate", str(spec))
    assert said.returncode == 1, said.stdout
    assert "lab: teacher model teacher in the workdir: vocabulary 300, 32 positions" in said.stdout
    assert "teacher model teacher has a vocabulary of 300 tokens and the students' " \
           "(distill.vocab) is 512" in " ".join(said.stderr.split())
