"""The spec's distillation: `role:`, a cluster's own `run`, `teacher:` and the job's
`distill:` section, with located errors; and the distill.json every cluster's hosts get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_cli.config import jobplan, plan_model, strict
from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.config.distill_plan import distill_config, labels_port
from nebula_cli.config.distill_spec import DistillSpec
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.config.spec import JobSpec, parse_spec
from nebula_cli.config.worlds import site_key
from nebula_cli.errors import SpecError
from nebula_cli.transport.local.conn import LocalConn

SPEC = """\
name: d
run: python train.py
relay: {}
distill: {topk: 16}
clusters:
  - name: lab
    transport: local
    hosts: [t1]
    role: teacher
    run: python serve.py
  - name: cloud
    transport: local
    hosts: [s1]
"""


def parse(text: str) -> JobSpec:
    return parse_spec(text, base_dir=Path(__file__).parent)


def problem(text: str) -> str:
    with pytest.raises(SpecError) as exc:
        parse(text)
    return str(exc.value)


def test_a_teacher_cluster_and_the_distill_section_with_their_defaults() -> None:
    spec = parse(SPEC)
    assert [c.role for c in spec.clusters] == ["teacher", "train"]
    assert spec.clusters[0].run == "python serve.py" and spec.clusters[1].run is None
    assert spec.distill == DistillSpec(topk=16)  # every other field: its one default
    assert spec.distill.temperature == DistillSpec().temperature


def test_the_defaults_are_the_measured_ones_sampled_labels_k_12_at_t_1_alpha_0_9() -> None:
    d = DistillSpec()
    assert (d.labels, d.topk, d.temperature, d.alpha) == ("sampled", 12, 1.0, 0.9)
    assert d.notes() == []
    assert d.summary() == ("12 sampled labels per token (ids only), temperature 1, alpha 0.9, "
                           "8 batches ahead, with no teacher: wait")
    top = DistillSpec(labels="topk", topk=32, values="int8")
    assert top.summary().startswith("top 32 labels per token (int8 values), temperature 1,")


@pytest.mark.parametrize("given, noted", [
    ({"topk": 32, "temperature": 2.0},
     "distill sets topk: 32, temperature: 2.0 but not `labels`"),
    ({"temperature": 2.0}, "distill sets temperature: 2.0 but not `labels`"),
    ({"values": "int8"}, "distill sets values: int8 but not `labels`"),  # sampled sends none
    ({"topk": 32, "labels": "topk"}, None),  # said what it means
    ({"topk": 12, "labels": "sampled"}, None),
    ({"alpha": 0.5}, None),  # alpha means the same with either kind of label
])
def test_a_spec_written_for_the_old_top_k_default_is_told_the_new_one(
        given: dict[str, object], noted: str | None) -> None:
    notes = DistillSpec(**given).notes()
    if noted is None:
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(noted), notes
        assert "the default is now `labels: sampled`" in notes[0]
        assert "write `labels: topk` to keep a top k" in notes[0]


def test_on_policy_says_what_the_students_get_and_notes_the_off_policy_settings() -> None:
    d = DistillSpec(mode="on_policy")
    assert d.on_policy and d.notes() == []
    assert d.summary().startswith("on-policy: the students' samples scored by the teacher "
                                  "(2 bytes a token back, both at temperature 1), alpha 0.9,")
    (note,) = DistillSpec(mode="on_policy", topk=32, labels="topk", temperature=2.0).notes()
    assert note.startswith("distill.mode: on_policy")
    assert "labels, topk, temperature apply to off-policy labels only" in note
    assert "one of 'off_policy', 'on_policy'" in problem(SPEC.replace("{topk: 16}",
                                                                      "{mode: online}"))


@pytest.mark.parametrize("edit, where, says", [
    (("distill: {topk: 16}\n", ""), "<spec>:8:11: clusters[0].role", "needs the job's `distill:`"),
    (("    run: python serve.py\n", ""), "<spec>:9:11: clusters[0].role", "needs its server"),
    (("    role: teacher\n", ""), "<spec>:4:10: distill", "needs a cluster with `role: teacher`"),
    (("relay: {}\n", ""), "clusters[0].role", "add `relay: {}`"),
    (("    run: python serve.py\n", "    run: python serve.py\n    teacher: {model: m}\n"),
     "clusters[0].teacher", "either its own `run` or the built-in server"),
    (("    role: teacher\n    run: python serve.py\n", "    teacher: {model: m}\n"),
     "clusters[0].teacher", "is for a cluster with `role: teacher`"),
    (("    hosts: [s1]\n", "    hosts: [s1]\n    role: teacher\n    run: python s.py\n"),
     "clusters[0].role", "every cluster is a teacher"),
    (("    role: teacher\n", "    role: student\n"), "<spec>:9:11: clusters[0].role",
     "expected one of 'train', 'teacher', found 'student'"),
    (("{topk: 16}", "{topk: 0}"), "<spec>:4:17: distill.topk", "an integer >= 1"),
    (("{topk: 16}", "{values: int4}"), "distill.values", "one of 'fp16', 'int8'"),
    (("{topk: 16}", "{labels: top}"), "distill.labels", "one of 'topk', 'sampled'"),
    (("{topk: 16}", "{when_no_teacher: skip}"), "distill.when_no_teacher",
     "one of 'wait', 'ce_only', found 'skip'"),
    (("run: python serve.py", "run: torchrun serve.py"), "clusters[0].run", "torchrun"),
    (("    run: python serve.py\n", "    teacher: {from_job: phase-a}\n"),
     "clusters[0].teacher", "needs its own `run:`"),
    (("    run: python serve.py\n", "    run: python serve.py\n    teacher: {model: m, "
      "checkpoint: c}\n"), "clusters[0].teacher", "found model, checkpoint"),
    (("    run: python serve.py\n", "    run: python serve.py\n    teacher: {checkpoint: c, "
      "from_cluster: east}\n"), "clusters[0].teacher", "`from_cluster` names a cluster of"),
    (("    role: teacher\n", "    role: teacher\n    relay_reach: outbound\n"),
     "clusters[0].relay_reach", "soft labels do not ride SSH tunnels yet"),
])
def test_distillation_problems_are_located(edit: tuple[str, str], where: str, says: str) -> None:
    text = SPEC.replace(*edit)
    assert text != SPEC
    message = problem(text)
    assert where in message and says in message, message


def sites(spec: JobSpec) -> dict[str, plan_model.Site]:
    return {site_key(c, h): plan_model.Site(
        conn=LocalConn(name=c.name, python="python3", home="/h"), home="/h",
        address=f"{c.name}.ex", bind="0.0.0.0", python="python3", shares_files=True)
        for c in spec.clusters for h in c.hosts}


def ports(spec: JobSpec, labels: dict[str, int]) -> plan_model.Ports:
    return plan_model.Ports(masters={c.name: 29500 + i for i, c in enumerate(spec.clusters)},
                            relays={c.name: (29400, 29401) for c in spec.clusters},
                            labels=labels)


def test_each_cluster_gets_its_view_of_the_distillation(tmp_path: Path) -> None:
    spec = parse(SPEC.replace("{topk: 16}", "{topk: 16, labels: topk, values: int8}"))
    assert spec.relay is not None and labels_port(spec) == spec.relay.port + 2
    port = 31999  # the planned port (a free one on the local transport), not the preferred
    teacher = distill_config(spec, "job-1", spec.clusters[0], "/a/lab", sites(spec),
                             ports(spec, {"lab": port}))
    student = distill_config(spec, "job-1", spec.clusters[1], "/a/cloud", sites(spec),
                             ports(spec, {"lab": port}))
    assert teacher.teacher and teacher.listen == f"0.0.0.0:{port}"
    assert not student.teacher and student.listen == ""
    # dialled at the address the teacher's gateway reported (as a relay is), not its name in
    # the spec (t1, which resolves nowhere on the local transport)
    assert student.teachers == teacher.teachers == {"lab": f"lab.ex:{port}"}
    assert teacher.students == {"cloud": 1} and student.values == "int8" and student.topk == 16
    assert student.tls.cert == "/a/cloud/certs/worker.pem"
    assert student.dead_after == spec.relay.dead_after
    sampled = parse(SPEC.replace("{topk: 16}", "{}"))  # sampled: the default
    drawn = distill_config(sampled, "job-1", sampled.clusters[1], "/a/cloud", sites(sampled),
                           ports(sampled, {"lab": port}))
    assert drawn.values == "draws" and drawn.topk == 12  # k draws, no values on the wire
    scoring = parse(SPEC.replace("{topk: 16}", "{mode: on_policy}"))
    scored = distill_config(scoring, "job-1", scoring.clusters[0], "/a/lab", sites(scoring),
                            ports(scoring, {"lab": port}))
    assert scored.values == "token" and scored.topk == 1  # one score a token, no ids back
    path = tmp_path / "distill.json"  # what the runtime loads, strictly
    path.write_bytes(strict.dumps(student))
    assert DistillConfig.load(path) == student
    data = json.loads(path.read_text())
    del data["topk"]
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="topk"):
        DistillConfig.load(path)


def test_a_teacher_serving_a_checkpoint_is_told_where_it_is() -> None:
    from nebula_cli.config.distill_config import TEACHER_CHECKPOINT_DIR, TEACHER_CHECKPOINT_ENV
    from nebula_cli.config.roles.teacher import TeacherRole

    for teacher, where in (("{from_job: phase-a}", f"/j/{TEACHER_CHECKPOINT_DIR}"),
                           ("{checkpoint: ckpt/east}", "ckpt/east")):
        spec = parse(SPEC.replace("    run: python serve.py\n",
                                  f"    run: python serve.py\n    teacher: {teacher}\n"))
        lab = spec.clusters[0]
        assert lab.teacher is not None and not lab.teacher.builtin and lab.run is not None

        class At:  # what TeacherRole.environment reads of the host being planned
            cluster, job_root = lab, "/j"

        env = TeacherRole().environment(At(), {})  # type: ignore[arg-type]
        assert env[TEACHER_CHECKPOINT_ENV] == where


def test_the_plan_runs_no_averaging_relay_on_a_teacher_and_names_none_to_students(
        tmp_path: Path) -> None:
    spec = parse(SPEC.replace("    hosts: [s1]\n", "    hosts: [s1]\n  - name: edge\n"
                              "    transport: local\n    hosts: [e1]\n"))
    site_of = sites(spec)
    certs = plan_model.Certs(ca=b"CA", relays={c.name: (b"c", b"k") for c in spec.clusters},
                             workers={k: (b"c", b"k") for k in site_of})
    plan = jobplan.build_plan(spec, "job-1", sites=site_of, ports=ports(spec, {"lab": 29402}),
                              certs=certs)
    assert sorted(a.cluster for a in plan.role(plan_model.RELAY)) == ["cloud", "edge"]
    relay = next(a for a in plan.role(plan_model.RELAY) if a.cluster == "cloud")
    (tmp_path / "relay.json").write_bytes(relay.files["relay.json"])
    cfg = RelayConfig.load(tmp_path / "relay.json")
    assert set(cfg.clusters) == {"cloud", "edge"} and set(cfg.peers) == {"edge"}
    teacher = next(a for a in plan.role(plan_model.WORKER) if a.cluster == "lab")
    assert "distill.json" in teacher.files and "sync.json" not in teacher.files
    assert teacher.config.processes[0].argv == ["/bin/sh", "-c", "python serve.py"]
