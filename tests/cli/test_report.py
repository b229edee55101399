"""`nebula report`: every record fetched from the hosts, one self-contained HTML page whose
image is a real, non-blank plot (also as rendered by headless Chromium), the figure as a PNG,
restarts and missed rounds marked, and TensorBoard runs that tensorboard's own reader parses."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.jobs import CLI, wait_for, write_spec

from nebula_cli.cli.palette import cluster_colours

LOSS_SCALE = {"east": 8.0, "west": 12.0}  # apart, so neither line hides the other
LOGGED = """
name: reported
workdir: .
run: >-
  python -c "import os; from nebula_cli.runtime import log;
  scale = SCALE[os.environ['NEBULA_CLUSTER']];
  [log(step=i, loss=scale / i, samples_per_s=10 * scale + i) for i in range(1, 41)];
  log(step=40, eval_loss=0.5);
  log(step=40, final=True, param_sha256='ab' * 32)"
clusters:
  - {name: east, transport: local, hosts: [{host: e1}]}
  - {name: west, transport: local, hosts: [{host: w1}]}
""".replace("SCALE", repr(LOSS_SCALE))


def test_report_draws_every_cluster_and_writes_tensorboard_runs(cli: CLI,
                                                                 tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    live = cli("launch", str(write_spec(tmp_path, LOGGED)), check=True).stdout  # the live view
    assert "loss trend" in live and "█" in live and "▁" in live  # loss falls: a sparkline
    (job_id,) = cli.job_ids()
    page = tmp_path / "out" / "report.html"
    page.parent.mkdir()
    proc = cli("report", job_id, "--output", str(page), check=True)
    assert "records" in proc.stdout and str(page) in proc.stdout
    text = page.read_text()
    (data,) = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    pixels = image.imread(io.BytesIO(base64.b64decode(data)), format="png")
    assert pixels.shape[0] > 400 and pixels.std() > 0.05  # drawn, not blank
    assert text.count("abababababababab") == 2  # both clusters' final parameters listed
    assert "all 2 workers hold identical parameters" in text and "warning" not in proc.stderr
    for cluster in ("east", "west"):
        run = EventAccumulator(str(cli.home / "jobs" / job_id / "tb" / cluster))
        run.Reload()
        loss = run.Scalars("loss")
        assert [e.step for e in loss] == list(range(1, 41))
        assert loss[-1].value == pytest.approx(LOSS_SCALE[cluster] / 40)
        assert [e.value for e in run.Scalars("eval_loss")] == [0.5]
    copies = sorted((cli.home / "jobs" / job_id / "metrics").glob("*/*/worker-*.jsonl"))
    assert [p.parent.parent.name for p in copies] == ["east", "west"]  # kept locally


def test_report_of_a_job_without_metrics_says_so(cli: CLI, tmp_path: Path) -> None:
    quiet = "name: quiet\nworkdir: .\nrun: 'true'\nclusters:\n" + LOGGED.split("clusters:\n")[1]
    job_id = cli("launch", str(write_spec(tmp_path, quiet)), "--detach",
                 check=True).stdout.strip()
    wait_for(lambda: json.loads(cli("status", job_id, "--json").stdout)["state"]
             == "SUCCEEDED", timeout=60)
    proc = cli("report", job_id)
    assert proc.returncode == 1 and f"no metrics recorded yet for {job_id}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sparkline_scales_between_the_values_it_shows() -> None:
    from nebula_cli.cli.ui import sparkline

    assert sparkline([]) == "" and sparkline([None, float("nan")]) == ""  # type: ignore[list-item]
    assert sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    line = sparkline([float(v) for v in range(100)], width=8)
    assert len(line) == 8 and line[0] == "▁" and line[-1] == "█"
    assert sparkline([5.0, 5.0]) == "▁▁"  # flat: no division by zero


ROUNDS = '''
"""What nebula's runtime records, logged by a script: loss every step, and per outer round
(every 10 steps) its stats with the clusters present. west fails once after its round at step
10 (its agent restarts it: it resumes from step 10, as from a checkpoint) and so misses round 1,
which east makes alone."""
import os
import sys
from pathlib import Path

from nebula_cli.runtime import log

cluster = os.environ["NEBULA_CLUSTER"]
failed = Path("west-failed")
start = 1
if cluster == "west" and failed.exists():
    log(step=10, resumed_from_step=10)
    start = 11
for step in range(start, 41):
    log(step=step, loss=8.0 / step, samples_per_s=100.0)
    if step % 10 == 0:
        r = step // 10 - 1
        present = ["east"] if r == 1 else ["east", "west"]
        if cluster in present:
            log(step=step, outer_round=r, round_s=0.5 + r, wan_bytes_sent=1000 * (r + 1),
                clusters_present=len(present), clusters=present)
    if cluster == "west" and step == 10 and not failed.exists():
        failed.touch()
        sys.exit(1)
'''


def test_the_report_marks_restarts_and_the_rounds_a_cluster_missed(
        cli: CLI, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    work = tmp_path / "work"
    work.mkdir()
    (work / "rounds.py").write_text(ROUNDS)
    spec = write_spec(tmp_path, f"""
        name: rounds
        workdir: {work}
        run: python rounds.py
        max_restarts: 1
        clusters:
          - {{name: east, transport: local, hosts: [{{host: e1}}]}}
          - {{name: west, transport: local, hosts: [{{host: w1}}]}}
        """)
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()
    status = wait_for(lambda: (st := json.loads(cli("status", job_id, "--json").stdout))[
        "state"] not in ("RUNNING", "STARTING") and st, timeout=90)
    assert status["state"] == "SUCCEEDED", status
    assert {h["cluster"]: h["restarts"] for h in status["hosts"]} == {"east": 0, "west": 1}
    page = tmp_path / "rounds.html"
    cli("report", job_id, "--output", str(page), check=True)
    rows = re.findall(r"<tr><td>(\w+)</td><td>(\d+)</td><td>(\d+)</td><td>([\d, ]*)</td></tr>",
                      page.read_text())
    assert rows == [("east", "0", "0", ""), ("west", "1", "1", "1")]  # restarts, missed, which


def test_the_report_says_when_the_workers_ended_with_different_parameters(
        cli: CLI, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    diverged = LOGGED.replace("param_sha256='ab' * 32",
                              "param_sha256=os.environ['NEBULA_CLUSTER'] * 8")
    job_id = cli("launch", str(write_spec(tmp_path, diverged)), "--detach", check=True
                 ).stdout.strip()
    wait_for(lambda: json.loads(cli("status", job_id, "--json").stdout)["state"]
             == "SUCCEEDED", timeout=90)
    page = tmp_path / "diverged.html"
    proc = cli("report", job_id, "--output", str(page), check=True)
    assert "warning: workers hold 2 different parameter sets at the end" in proc.stderr
    assert "<b>workers hold 2 different parameter sets</b>" in page.read_text()


def chromium() -> str | None:
    """Debian's chromium, or None (then skipped, except in CI: .ci/run installs it)."""
    found = shutil.which("chromium")
    if found is None and os.environ.get("CI") == "true":
        pytest.fail("chromium is missing in CI (.ci/run installs Debian's chromium package)")
    return found


def screenshot(browser: str, page: Path, out: Path, profile: Path) -> None:
    """A headless screenshot of a local page, with nothing that reaches out (no sync, updates,
    QUIC, background requests); every process it started is ended."""
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--window-size=1200,1000",
            "--hide-scrollbars", f"--screenshot={out}", page.as_uri()]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the browser's helpers, if any are left
        proc.wait()
    assert proc.returncode == 0 and out.is_file(), output.decode(errors="replace")[-2000:]


def test_the_page_renders_in_headless_chromium_and_the_png_is_the_figure(
        cli: CLI, tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    browser = chromium()
    cli("launch", str(write_spec(tmp_path, LOGGED)), check=True)
    (job_id,) = cli.job_ids()
    png = tmp_path / "report.png"
    cli("report", job_id, "--output", str(png), check=True)
    figure = image.imread(str(png))
    # four panels (train loss by step and time, eval loss, samples/s), two a row: 12 x 7.2 in
    assert figure.shape[:2] == (720, 1200) and figure.std() > 0.05  # at 100 dpi
    bad = cli("report", job_id, "--output", str(tmp_path / "report.txt"))
    assert bad.returncode == 2 and "written as .html or .png (found .txt)" in bad.stderr
    if browser is None:
        pytest.skip("no chromium here (apt-get install chromium); the PNG was checked")

    page = tmp_path / "report.html"
    cli("report", job_id, "--output", str(page), check=True)
    shot = tmp_path / "shot.png"
    screenshot(browser, page, shot, tmp_path / "chromium-profile")
    pixels = image.imread(str(shot))[:, :, :3]
    assert pixels.shape[:2] == (1000, 1200)
    assert pixels.std() > 0.05 and (pixels < 0.9).any(axis=2).mean() > 0.02  # not blank
    for colour in cluster_colours(["east", "west"]).values():  # both lines, live-view hues
        rgb = tuple(int(colour.page[i:i + 2], 16) for i in (1, 3, 5))
        near = (abs(pixels * 255 - rgb) < 30).all(axis=2).sum()
        assert near > 200, (rgb, near)
