"""cli/ui: the per-cluster metrics table of `nebula status` and the live view."""

from __future__ import annotations

from rich.console import Console

from nebula_cli.cli.ui import metrics_table


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
