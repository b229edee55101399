"""cli/ui: the per-cluster metrics table of `nebula status` and the live view."""

from __future__ import annotations

from pathlib import Path

from helpers.old_state import old_home
from rich.console import Console

from nebula_cli.cli.ui import job_detail, metrics_table
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


def test_status_notes_a_node_with_what_its_scheduler_said_in_a_record_of_the_last_version(
        tmp_path: Path) -> None:
    with StateStore(old_home(tmp_path / "home")) as store:
        (job,) = store.list_jobs()
        shown = _text(job_detail(JobSnapshot(job, store.hosts(job.id))))
    rows = {line.split("│")[1].strip(): line for line in shown.splitlines()
            if line.lstrip().startswith("hpc")}
    assert "Slurm job 12 RUNNING on n[1-2]" in rows["n1"] and "Slurm job" in rows["n2"]
    assert "Slurm job" not in rows["login"]
