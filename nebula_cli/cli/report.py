"""`nebula report`: a job's records fetched from its hosts, drawn as one self-contained HTML
page or one PNG (`report_draw`), and its TensorBoard runs in $NEBULA_HOME/jobs/<id>/tb.

The TensorBoard runs are those the workers wrote when the spec asked (`metrics: {tensorboard:
true}`), copied from the hosts; otherwise they are made here from the records. What cannot be
made for want of the `report` extra is said, with the extra; the command fails only when
nothing could be made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nebula_cli.cli.report_draw import DPI, EXTRA, figure_png, html_page, write_tensorboard
from nebula_cli.control import final_parameters
from nebula_cli.control.final_parameters import newest_finals
from nebula_cli.control.jobs import JobOps
from nebula_cli.control.metric_records import fetch_records, fetch_tensorboard, tensorboard_hosts
from nebula_cli.errors import NebulaError, UsageError

FORMATS = {".html": "html", ".htm": "html", ".png": "png"}
"""What `--output` may end with, and what it then holds."""


@dataclass
class Report:
    records: int = 0
    page: Path | None = None
    """The HTML page or PNG written (None: matplotlib missing)."""
    tensorboard: Path | None = None
    """The job's TensorBoard runs (None: none there, tensorboard missing)."""
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the PNG left out and why (the HTML page says it in a table of its own)."""


def output_format(path: Path) -> str:
    """'html' or 'png', from the file name; UsageError for anything else."""
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UsageError(f"--output {path}: the report is written as .html or .png "
                         f"(found {path.suffix or 'no suffix'})")
    return kind


def make_report(ops: JobOps, job_id: str, output: Path | None) -> Report:
    """Fetch, draw and write; `output` defaults to the job's report.html."""
    page = output or ops.store.job_dir(job_id) / "report.html"
    kind = output_format(page)
    found = fetch_records(ops, job_id)
    made = Report(records=len(found.records))
    made.warnings += [f"{where}: {why} (its last copy used)"
                      for where, why in found.unreachable.items()]
    if not found.workers():
        raise NebulaError(f"no metrics recorded yet for {job_id}")
    job = ops.store.get_job(job_id)
    order = job.clusters  # the live view's order, and so its colours
    said = final_parameters.of_job(job, newest_finals(found.workers()))
    if said is not None and not said.identical:
        made.warnings.append(f"{said.sentence()} at the end (see the report's final parameters)")
    try:
        if kind == "png":
            png, omitted = figure_png(found.records, DPI["png"], order)
            page.write_bytes(png)
            made.notes += [f"panel '{o.title}' left out: {o.reason}" for o in omitted]
        else:
            page.write_text(html_page(found.records, job_id, order, said))
        made.page = page
    except ImportError as exc:
        made.warnings.append(f"no {kind.upper()} report: {exc}; {EXTRA}")
    tb = ops.store.job_dir(job_id) / "tb"
    if tensorboard_hosts(ops, job_id):  # the workers wrote them: copy what is new
        copy = fetch_tensorboard(ops, job_id)
        made.warnings += [f"{where}: {why} (its TensorBoard files as last copied)"
                          for where, why in copy.unreachable.items()]
        made.tensorboard = tb if copy.files else None
    else:
        try:
            write_tensorboard(found.records, tb)
            made.tensorboard = tb
        except ImportError as exc:
            made.warnings.append(f"no TensorBoard runs: {exc}; {EXTRA}")
    return made


def copy_tensorboard(ops: JobOps, job_id: str) -> list[str]:
    """For `nebula logs`: copy the TensorBoard runs the workers wrote (if the spec asked for
    them); the lines to show on stderr."""
    if not tensorboard_hosts(ops, job_id):
        return []
    copy = fetch_tensorboard(ops, job_id)
    lines = [f"warning: {where}: {why} (its TensorBoard files as last copied)"
             for where, why in copy.unreachable.items()]
    return [*lines, f"TensorBoard: {copy.files} event file(s) in {copy.directory} "
                    f"(tensorboard --logdir {copy.directory})"]
