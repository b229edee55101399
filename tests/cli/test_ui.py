"""cli/ui: the per-cluster metrics table of `nebula status` and the live view."""

from __future__ import annotations

from pathlib import Path

from helpers.old_state import old_home
from helpers.plan_defaults import minimal_spec
from rich.console import Console

from nebula_cli.cli.ui import distill_verdict, job_detail, metrics_table, sync_summary
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.control.jobs import JobSnapshot
from nebula_cli.control.state import StateStore


def _text(table: object) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(table)
    return console.export_text()


def test_soft_labels_column_only_in_a_job_with_students() -> None:
    """A student cluster shows the batches it trained with soft labels, of all, and those
    without; a teacher cluster before its first record shows '-'; a job without distillation
    has no such column."""
    latest = {"cloud": {"step": 40, "loss": 2.5, "distill_batches": 40,
                        "distill_without_labels": 3, "distill_kd": 0.4321},
              "lab": {"step": 0}}
    shown = _text(metrics_table(["lab", "cloud"], latest, {}))
    assert "soft labels" in shown
    cloud = next(line for line in shown.splitlines() if line.lstrip().startswith("cloud"))
    assert "37/40 (3 without), KD 0.432" in cloud
    lab = next(line for line in shown.splitlines() if line.lstrip().startswith("lab"))
    assert "37/40" not in lab
    latest["lab"] = {"step": 120, "teacher_answers": 120, "teacher_answers_per_s": 7.5,
                     "teacher_latency_ms": 41.6, "teacher_queue": 2}
    shown = _text(metrics_table(["lab", "cloud"], latest, {}))
    lab = next(line for line in shown.splitlines() if line.lstrip().startswith("lab"))
    assert "7.5 answers/s, 42 ms, queue 2" in lab  # the teacher's figures
    teacher_only = _text(metrics_table(["lab"], {"lab": latest["lab"]}, {}))
    assert "soft labels" in teacher_only
    plain = _text(metrics_table(["east"], {"east": {"step": 3, "loss": 1.0}}, {}))
    assert "soft labels" not in plain and "east" in plain


def test_the_teachers_and_the_students_loss_on_their_batches_side_by_side() -> None:
    """Each cluster's CE in its soft labels column; under the table both, and a warning when
    the teacher is no better than a student on the student's own batches."""
    latest = {"lab": {"teacher_answers": 90, "teacher_answers_per_s": 3.0,
                      "teacher_latency_ms": 20.0, "teacher_queue": 0, "teacher_ce": 2.3141},
              "cloud": {"distill_batches": 90, "distill_kd": 0.2, "distill_ce": 2.9512},
              "edge": {"distill_batches": 80}}
    shown = _text(metrics_table(["lab", "cloud", "edge"], latest, {}))
    assert "queue 0, CE 2.314" in shown and "90/90, KD 0.200, CE 2.951" in shown
    said = [t.plain for t in distill_verdict(["lab", "cloud", "edge"], latest)]
    assert said == ["loss on the students' batches: teacher lab 2.314, student cloud 2.951"]
    latest["cloud"]["distill_ce"] = 2.2
    [line, warning] = [t.plain for t in distill_verdict(["lab", "cloud"], latest)]
    assert warning == ("the teacher is no better than student cloud on its own batches (CE "
                       "2.314 against 2.200): distillation cannot help it; check the teacher's "
                       "model (its checkpoint, its tokenizer) or train without it")
    assert distill_verdict(["cloud"], {"cloud": latest["cloud"]}) == []  # no teacher figure yet
    assert distill_verdict(["lab", "edge"], latest) == []  # no student loss yet


def test_status_notes_a_node_with_what_its_scheduler_said_in_a_record_of_the_last_version(
        tmp_path: Path) -> None:
    with StateStore(old_home(tmp_path / "home")) as store:
        (job,) = store.list_jobs()
        shown = _text(job_detail(JobSnapshot(job, store.hosts(job.id))))
    rows = {line.split("│")[1].strip(): line for line in shown.splitlines()
            if line.lstrip().startswith("hpc")}
    assert "Slurm job 12 RUNNING on n[1-2]" in rows["n1"] and "Slurm job" in rows["n2"]
    assert "Slurm job" not in rows["login"]


def test_the_sync_line_says_the_error_feedback_decay_only_when_it_is_set() -> None:
    spec = minimal_spec()
    assert spec.relay is not None
    assert sync_summary(spec).endswith("with error feedback")
    comp = spec.relay.compression.model_copy(update={"codec": "topk", "feedback_decay": 0.95})
    decayed = spec.model_copy(update={"relay": spec.relay.model_copy(
        update={"compression": comp})})
    assert sync_summary(decayed).endswith("2 bits) with error feedback (decay 0.95)")
    comp = comp.model_copy(update={"codec": "auto", "feedback_decay": None})
    auto = spec.model_copy(update={"relay": spec.relay.model_copy(update={"compression": comp})})
    assert TopKParams.feedback_decay == 0.7  # each codec's own, said per codec where not 1
    assert sync_summary(auto).endswith("with error feedback (decay 0.7 with topk)")
    topk = comp.model_copy(update={"codec": "topk"})
    own = spec.model_copy(update={"relay": spec.relay.model_copy(update={"compression": topk})})
    assert sync_summary(own).endswith("2 bits) with error feedback (decay 0.7)")
