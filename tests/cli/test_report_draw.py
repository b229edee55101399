"""cli/report_draw.py: the report of a real two-cluster job, checked from the figure's own
objects: no axis has an offset, every axis is labelled, no panel is empty, the throughput panel
shows what the workers logged (tokens/s here), bytes are in human units on an absolute axis,
a cluster's line breaks across a round it missed, and each cluster has its live-view colour.
Panels with nothing to draw are left out and the page says why."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from helpers.jobs import CLI, wait_for, write_spec

from nebula_cli.cli.palette import cluster_colours
from nebula_cli.control.follow import parse_metric

# Logged as nebula's runtime logs it: loss and tokens/s every step; per outer round (every 10
# steps) 1.32 MB sent, the round's time and the clusters present. west misses round 2.
# Listed west first: the job's order, not the names' (the colours follow the job's order).
ROUNDS = '''
import os
from nebula_cli.runtime import log
cluster = os.environ["NEBULA_CLUSTER"]
scale = 8.0 if cluster == "east" else 12.0
for step in range(1, 51):
    log(step=step, loss=scale / step, tokens_per_s=1000.0 + step)
    if step % 10 == 0:
        r = step // 10 - 1
        present = ["east"] if r == 2 else ["east", "west"]
        if cluster in present:
            log(step=step, outer_round=r, round_s=0.5 + 0.01 * r,
                wan_bytes_sent=1_320_000 + r, wan_bytes_received=1_310_000,
                clusters_present=len(present), clusters=present)
log(step=50, eval_loss=scale / 60)
log(step=50, final=True, param_sha256="ab" * 32)
'''


def _records(home: Path, job_id: str) -> list[dict[str, Any]]:
    """The job's records as `nebula report` fetched them (its local copies)."""
    out = []
    for path in sorted((home / "jobs" / job_id / "metrics").glob("*/*/*.jsonl")):
        role = path.name.split("-", 1)[0]
        for line in path.read_text().splitlines():
            if (m := parse_metric(line)) is not None:
                out.append({**m, "role": role, "cluster": m.get("cluster",
                                                                  path.parent.parent.name)})
    return out


@pytest.fixture
def reported(cli: CLI, tmp_path: Path) -> tuple[str, list[dict[str, Any]], str]:
    """A real two-cluster job (west listed first), its report page, and its records."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "rounds.py").write_text(ROUNDS)
    spec = write_spec(tmp_path, f"""
        name: drawn
        workdir: {work}
        run: python rounds.py
        clusters:
          - {{name: west, transport: local, hosts: [{{host: w1}}]}}
          - {{name: east, transport: local, hosts: [{{host: e1}}]}}
        """)
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()
    wait_for(lambda: json.loads(cli("status", job_id, "--json").stdout)["state"]
             == "SUCCEEDED", timeout=90)
    page = tmp_path / "report.html"
    cli("report", job_id, "--output", str(page), check=True)
    return job_id, _records(cli.home, job_id), page.read_text()


def test_every_panel_is_labelled_absolute_and_drawn(reported) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from nebula_cli.cli.report_draw import draw

    _, records, page = reported
    drawing = draw(records, ["west", "east"])
    fig = drawing.figure
    try:
        fig.canvas.draw()  # offsets and tick labels exist only once drawn
        titles = [ax.get_title() for ax in fig.axes]
        assert len(fig.axes) == len(drawing.panels) == 7, titles  # nothing empty left in
        for ax in fig.axes:
            assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
            for axis in (ax.xaxis, ax.yaxis):
                assert axis.get_offset_text().get_text() == "", (ax.get_title(), "offset")
            assert ax.lines, f"{ax.get_title()}: an empty panel"
            drawn = [y for line in ax.lines for y in line.get_ydata() if not math.isnan(y)]
            assert drawn, ax.get_title()
        by_title = {ax.get_title(): ax for ax in fig.axes}
        rate = by_title["throughput (tokens/s)"]
        assert rate.get_ylabel() == "tokens/s"
        east = next(line for line in rate.lines if line.get_label() == "east")
        assert list(east.get_ydata()) == [1000.0 + s for s in range(1, 51)]  # what was logged
        wan = by_title["WAN traffic per round"]
        assert wan.get_ylabel() == "MB per round"
        sent = next(line for line in wan.lines if line.get_label() == "east sent")
        assert sent.get_ydata()[0] == pytest.approx(1.32)  # 1,320,000 B as MB, not an offset
        assert wan.get_ylim()[0] == 0  # absolute: bytes are never negative
        ticks = [t.get_text() for t in wan.get_yticklabels() if t.get_text()]
        assert not any(t.startswith(("−", "-")) for t in ticks), ticks
        rounds = by_title["outer round time"]
        west = next(line for line in rounds.lines if line.get_label() == "west")
        xs = list(west.get_xdata())
        assert sum(math.isnan(x) for x in xs) == 1 and len(xs) == 5  # a gap at round 2
        assert any(c.get_label() == "west: missed round" for c in rounds.collections)
        colours = cluster_colours(["west", "east"])  # the live view's, by the job's order
        assert west.get_color() == colours["west"].page
        assert next(line for line in rounds.lines if line.get_label() == "east").get_color() \
            == colours["east"].page
    finally:
        plt.close(fig)
    assert "panels left out" not in page  # every panel had something to draw
    assert "tokens/s" in page and "<th>checkpoint</th>" in page
    # east made 5 rounds of 1,320,000 + r bytes: 6.6 MB sent in all, as the live view says it
    assert "<td>6.6 MB</td>" in page and "<th>WAN sent</th>" in page


def test_panels_with_nothing_to_draw_are_left_out_and_said_why(cli: CLI,
                                                               tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = write_spec(tmp_path, """
        name: bare
        workdir: .
        run: >-
          python -c "from nebula_cli.runtime import log;
          [log(step=i, loss=5.0 / i, samples_per_s=3.0) for i in range(1, 11)]"
        clusters:
          - {name: east, transport: local, hosts: [{host: e1}]}
          - {name: west, transport: local, hosts: [{host: w1}]}
        """)
    cli("launch", str(spec), check=True)
    (job_id,) = cli.job_ids()
    page = tmp_path / "bare.html"
    cli("report", job_id, "--output", str(page), check=True)
    text = page.read_text()
    assert "panels left out" in text
    for title in ("eval loss by step", "outer round time", "WAN traffic per round",
                  "clusters present per round"):
        assert f"<td>{title}</td>" in text
    assert "the workers logged no eval_loss" in text
    assert "<th>samples/s</th>" in text  # the throughput they did log, named
    png = cli("report", job_id, "--output", str(tmp_path / "bare.png"), check=True)
    assert "panel 'eval loss by step' left out: the workers logged no eval_loss" in png.stderr


def test_a_student_clusters_soft_labels_are_a_table_and_other_jobs_have_none() -> None:
    from nebula_cli.cli.report_draw import by_cluster, soft_labels_table

    def rec(cluster: str, step: int, **kw: Any) -> dict[str, Any]:
        return {"ts": 100.0 + step, "role": "worker", "rank": 0, "cluster": cluster,
                "step": step, **kw}

    records = [rec("cloud", 20, distill_batches=20, distill_without_labels=0,
                   distill_bytes_per_token=9.5, distill_wait_s=0.25, distill_longest_wait_s=0.1,
                   distill_kd=0.75),
               rec("cloud", 30, loss=2.0),
               rec("cloud", 40, distill_batches=40, distill_without_labels=3,
                   distill_bytes_per_token=9.25, distill_wait_s=1.5, distill_longest_wait_s=1.0,
                   distill_kd=0.25),
               rec("east", 40, loss=2.0)]
    table = soft_labels_table(by_cluster(records, ["east", "cloud"]))
    assert ("<tr><td>cloud</td><td>40</td><td>3</td><td>9.2</td><td>1.50</td><td>1.00</td>"
            "<td>0.7500</td><td>0.2500</td></tr>") in table  # the KD term, first and last
    assert "<th>KD, first</th><th>KD, last</th>" in table
    assert "east" not in table
    assert soft_labels_table(by_cluster([rec("east", 40, loss=2.0)])) == ""


def test_a_teacher_clusters_answers_are_a_table() -> None:
    from nebula_cli.cli.report_draw import by_cluster, soft_labels_table, teacher_table

    def rec(ts: float, answers: int, rate: float, latency: float | None, queue: int
            ) -> dict[str, Any]:
        return {"ts": ts, "role": "worker", "rank": 0, "cluster": "lab", "step": answers,
                "teacher_answers": answers, "teacher_tokens": 64 * answers,
                "teacher_answers_per_s": rate, "teacher_latency_ms": latency,
                "teacher_queue": queue}

    records = [rec(100.0, 10, 2.0, 30.0, 0), rec(105.0, 60, 10.0, 50.0, 4),
               rec(110.0, 60, 0.0, None, 0)]
    table = teacher_table(by_cluster(records))
    # 50 answers in the 10 s between the first and last records; busiest 10/s; latency: the
    # mean of the intervals that answered (30, 50) and the worst; the longest queue
    assert ("<tr><td>lab</td><td>60</td><td>3840</td><td>5.00</td><td>10.00</td><td>40.0</td>"
            "<td>50.0</td><td>4</td></tr>") in table
    assert table in soft_labels_table(by_cluster(records))  # in the report's distill part
    assert teacher_table(by_cluster([rec(100.0, 0, 0.0, None, 0)])).count("<td>-</td>") == 3


# A host's script that writes its own records straight into its metrics file (as a host that
# is not to be trusted can): its rank, step and outer round are markup, not numbers.
FORGED = '''
import json, os
mark = "<i class=forged>" + os.environ["NEBULA_CLUSTER"] + "</i>"
os.makedirs(os.path.dirname(os.environ["NEBULA_METRICS_FILE"]), exist_ok=True)
with open(os.environ["NEBULA_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"ts": 1.0, "step": 1, "rank": 0, "loss": 1.0}) + "\\n")
    if os.environ["NEBULA_CLUSTER"] == "east":  # a round west missed, named in markup
        f.write(json.dumps({"ts": 2.0, "step": 2, "rank": 0, "outer_round": mark,
                            "clusters": ["east"]}) + "\\n")
    f.write(json.dumps({"ts": 3.0, "step": mark, "rank": mark, "final": True,
                        "param_sha256": "ab" * 32}) + "\\n")
'''


class _Elements(HTMLParser):
    """Every element a page holds, with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def test_what_a_host_sent_is_text_on_the_page_never_markup(cli: CLI, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    work = tmp_path / "work"
    work.mkdir()
    (work / "forged.py").write_text(FORGED)
    spec = write_spec(tmp_path, f"""
        name: forged
        workdir: {work}
        run: python forged.py
        clusters:
          - {{name: west, transport: local, hosts: [{{host: w1}}]}}
          - {{name: east, transport: local, hosts: [{{host: e1}}]}}
        """)
    cli("launch", str(spec), check=True)
    (job_id,) = cli.job_ids()
    page = tmp_path / "forged.html"
    cli("report", job_id, "--output", str(page), check=True)
    text = page.read_text()
    parser = _Elements()
    parser.feed(text)
    assert [e for e in parser.elements if e[0] == "i"] == [], "a host's markup became markup"
    # each forged value is on the page, as text: the round west missed, the final's rank and step
    assert text.count("<td>&lt;i class=forged&gt;west&lt;/i&gt;</td>") == 2  # rank, step
    # east's also as its newest round and as the round west missed
    assert text.count("<td>&lt;i class=forged&gt;east&lt;/i&gt;</td>") == 4
