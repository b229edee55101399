"""`nebula report`: every record fetched from the hosts, one self-contained HTML page whose
image is a real, non-blank plot, and TensorBoard runs that tensorboard's own reader parses."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from conftest import CLI, wait_for, write_spec

LOGGED = """
name: reported
workdir: .
run: >-
  python -c "from nebula_cli.runtime import log;
  [log(step=i, loss=8.0 / i, samples_per_s=100.0 + i) for i in range(1, 41)];
  log(step=40, eval_loss=0.5);
  log(step=40, final=True, param_sha256='ab' * 32)"
clusters:
  - {name: east, transport: local, hosts: [{host: e1}]}
  - {name: west, transport: local, hosts: [{host: w1}]}
"""


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
    for cluster in ("east", "west"):
        run = EventAccumulator(str(cli.home / "jobs" / job_id / "tb" / cluster))
        run.Reload()
        loss = run.Scalars("loss")
        assert [e.step for e in loss] == list(range(1, 41))
        assert loss[-1].value == pytest.approx(8.0 / 40)
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
