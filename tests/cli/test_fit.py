"""cli/fit: tables fitted to the terminal. Every table `nebula status`, the live view and
`validate --hosts` print, drawn at 80 columns with realistic values: no value cut (no "…"),
the columns that matter kept, a stacked column's values said under the table."""

from __future__ import annotations

import re
import time

import pytest
from rich.console import Console

from nebula_cli.cli.fit import Column, FittedTable, fitted_columns
from nebula_cli.cli.netbench_render import bench_matrix
from nebula_cli.cli.planner_render import advisor_table, outer_memory_table, placement_table
from nebula_cli.cli.reach_render import reach_table
from nebula_cli.cli.ui import (
    final_summary,
    host_checks_table,
    job_detail,
    jobs_table,
    metrics_table,
    status_panel,
)
from nebula_cli.config.reach import Link
from nebula_cli.control.final_parameters import ParameterVerdict
from nebula_cli.control.hostcheck import HostCheck
from nebula_cli.control.jobs import JobSnapshot
from nebula_cli.control.reachcheck import DIRECT, TUNNEL, PairCheck, ReachReport, Way
from nebula_cli.control.state import HostRecord, JobRecord
from nebula_cli.planner import advise
from nebula_cli.planner.costmodel import Cost
from nebula_cli.planner.outer_memory import job_memory
from nebula_cli.planner.placement import Placement, PlacementResult

NOW = time.time()
SPEC = {"clusters": [{"name": "east", "hosts": ["e1", "e2"]},
                     {"name": "west-cloud", "hosts": ["w1"]}]}


def draw(renderable: object, width: int = 80) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable, crop=False)  # a table wider than the terminal shows as such
    return console.export_text()


def uncut(text: str) -> None:
    assert "…" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text


def job(job_id: str = "quickstart-20261203-125814-24ff", state: str = "SUCCEEDED") -> JobRecord:
    return JobRecord(id=job_id, name=job_id.rsplit("-", 3)[0], spec_path=None, spec=SPEC,
                     state=state, created=NOW - 4000, started=NOW - 3925, ended=NOW - 100,
                     reason=None)


def test_the_narrowest_columns_go_first_and_the_first_never() -> None:
    columns = [Column("a"), Column("b", keep=10), Column("c", keep=50), Column("d", keep=10)]
    rows = [["x" * 10, "y" * 10, "z" * 10, "w" * 10]]
    assert fitted_columns(columns, rows, 200, edge=True) == [0, 1, 2, 3]
    assert fitted_columns(columns, rows, 40, edge=True) == [0, 1, 2]  # equal keep: the right
    assert fitted_columns(columns, rows, 30, edge=True) == [0, 2]
    assert fitted_columns(columns, rows, 5, edge=True) == [0]
    with pytest.raises(ValueError, match="a row of 2 cells in a table of 4 columns"):
        FittedTable(columns).add_row("x", "y")


def test_a_stacked_column_that_goes_is_said_under_the_table() -> None:
    table = FittedTable([Column("host"), Column("state", keep=90),
                         Column("note", keep=10, stack=True)], name=(0,))
    table.add_row("e1", "FAILED", "exit 137 (killed: out of memory?) " + "x" * 40)
    table.add_row("e2", "RUNNING", "")
    wide, narrow = draw(table, 200), draw(table, 40)
    assert "note" in wide and "exit 137" in wide
    assert "note" not in narrow.splitlines()[1]
    assert "e1 note: exit 137 (killed: out of memory?)" in " ".join(narrow.split())
    assert "e2 note" not in narrow


def test_the_jobs_table_shows_each_job_by_name_and_short_id_at_80_columns() -> None:
    jobs = [job(), job("a-much-longer-job-name-20261203-130102-0a1b", "RUNNING")]
    shown = draw(jobs_table(jobs))
    uncut(shown)
    for word in ("quickstart", "24ff", "a-much-longer-job-name", "0a1b", "SUCCEEDED",
                 "RUNNING"):
        assert word in shown, (word, shown)
    assert re.search(r"1h0\dm\d\ds", shown), shown
    assert "20261203-125814" not in shown  # the long id is not what takes the room


def _hosts() -> list[HostRecord]:
    out = []
    for cluster, host, role, state, note in (
            ("east", "e1", "relay", "RUNNING", None), ("east", "e1", "worker", "RUNNING", None),
            ("east", "e2", "worker", "FAILED", "rank 1 exited 137 (SIGKILL: out of memory?)"),
            ("west-cloud", "w1.example.org", "worker", "RESTARTING", "host unreachable")):
        detail = {"agent_pid": 123456, "reason": note} if note else {"agent_pid": 123456}
        out.append(HostRecord(job_id="quickstart-20261203-125814-24ff", cluster=cluster,
                              host=host, role=role, node_rank=0, slots=2, agent_dir="/x",
                              state=state, pid=2345678, restarts=3, exit_code=137,
                              detail=detail))
    return out


def _metrics() -> tuple[dict[str, dict[str, object]], dict[str, dict[str, object]]]:
    latest = {"east": {"step": 123456, "loss": 1.73456, "eval_loss": 1.81234,
                       "tokens_per_s": 123456.0, "outer_round": 1234, "round_s": 12.345,
                       "clusters_present": 2, "checkpoint_step": 120000,
                       "resumed_from_step": 60000},
              "west-cloud": {"step": 123400, "loss": 1.70001, "tokens_per_s": 98765.0,
                             "outer_round": 1234}}
    relay = {"east": {"bytes_sent_total": 123.4e9, "bytes_received_total": 98.7e9},
             "west-cloud": {"bytes_sent_total": 1.2e9, "bytes_received_total": 3.4e9}}
    return latest, relay


def test_status_of_one_job_keeps_every_number_whole_at_80_columns() -> None:
    latest, relay = _metrics()
    shown = draw(job_detail(JobSnapshot(job(), _hosts()), latest, relay))
    uncut(shown)
    for number in ("123456", "1.735", "1.812", "1234", "120000", "137"):
        assert number in shown, (number, shown)
    assert "2345678" in draw(job_detail(JobSnapshot(job(), _hosts()), latest, relay), 160)
    note = "rank 1 exited 137 (SIGKILL: out of memory?)"
    assert all(word in shown for word in note.split()), shown  # wrapped at its words
    assert "host unreachable" in shown and "RESTARTING" in shown and "w1.example.org" in shown
    assert note in draw(job_detail(JobSnapshot(job(), _hosts()), latest, relay), 160)


def test_the_live_views_panel_keeps_every_number_whole_at_80_columns() -> None:
    latest, relay = _metrics()
    history = {"east": [{"loss": 2.0 - i / 10} for i in range(10)]}
    shown = draw(status_panel(JobSnapshot(job(state="RUNNING"), _hosts()), latest, relay,
                              history))
    uncut(shown)
    for number in ("123456", "1.735", "1234", "120000"):
        assert number in shown, (number, shown)


def test_the_final_summary_and_host_checks_keep_their_values_whole_at_80_columns() -> None:
    finals = [{"cluster": c, "host": h, "rank": r, "step": 123456, "first_loss": 10.12345,
               "last_loss": 1.70123, "eval_loss": 1.81234, "s_per_step": 0.1234,
               "param_sha256": "0123456789abcdef" * 4}
              for c, h, r in (("east", "e1", 0), ("east", "e2", 1), ("west-cloud", "w1", 0))]
    said = ParameterVerdict(workers=3, sets=1, unknown=0, stages=None)
    summary = draw(final_summary(finals, ["east", "west-cloud"], said))
    uncut(summary)
    assert re.search(r"west-cloud\s+w1\s+0\s+123456", summary.replace("│", "")), summary
    assert "1.701" in summary and "0123456789abcdef" in summary
    refused = ("ssh: connect to host w1 port 22: Connection refused; check the address and "
               "that sshd runs")
    checks = [HostCheck(cluster="east", host="e1.example.org", slots=8, reachable=True,
                        python="3.11.2", torch="2.5.1+cu124", deepspeed="0.16.2",
                        free_bytes=1234 * 10**9, interface="eth0"),
              HostCheck(cluster="west-cloud", host="w1", slots=4, reachable=False,
                        error=refused)]
    hosts = draw(host_checks_table(checks))
    uncut(hosts)
    assert "e1.example.org" in hosts and "2.5.1+cu124" in hosts
    assert all(word in hosts for word in refused.split()), hosts


def test_a_distillation_jobs_soft_labels_stay_readable_at_80_columns() -> None:
    latest, relay = _metrics()
    latest["east"].update(distill_batches=40, distill_without_labels=3, distill_kd=0.4321)
    latest["west-cloud"].update(teacher_answers=120, teacher_answers_per_s=7.5,
                                teacher_latency_ms=41.6, teacher_queue=2)
    shown = draw(metrics_table(["east", "west-cloud"], latest, relay))
    uncut(shown)
    for said in ("37/40", "(3", "without),", "KD 0.432", "7.5", "answers/s,", "42 ms,",
                 "queue 2"):
        assert said in shown, (said, shown)
    assert "east checkpoint: 120000 (resumed 60000)" in shown  # stacked, not lost
    assert "west-cloud checkpoint" not in shown  # it has none: nothing said


def test_the_plans_memory_and_the_relays_reach_fit_80_columns() -> None:
    memory = draw(outer_memory_table(7_000_000_000, job_memory(7_000_000_000,
                                                               {"east": 16, "west-cloud": 8})))
    uncut(memory)
    assert "7,000,000,000" in " ".join(memory.split()) and "total" in memory
    assert re.search(r"west-cloud\s+│\s+relay", memory), memory
    pair = PairCheck("east", "west-cloud", Link("east", "west-cloud", tunnel=True), {
        ("east", "west-cloud", DIRECT): Way(False, "timed out after 5 s (a firewall?)"),
        ("west-cloud", "east", DIRECT): Way(True, "connected"),
        ("east", "west-cloud", TUNNEL): Way(True, "sshd OpenSSH_9.2p1")})
    reach = draw(reach_table(ReachReport([pair], [])))
    uncut(reach)
    for said in ("timed", "firewall?)", "connected", "OpenSSH_9.2p1", "works"):
        assert said in reach, (said, reach)


def test_bench_networks_matrix_of_three_clusters_fits_80_columns_one_figure_a_line() -> None:
    names = ["east", "west-cloud", "north"]

    def pair(a: str, b: str, mbit: float, ms: float) -> dict[str, object]:
        return {"a": a, "b": b, "throughput_mbit": mbit, "plain_throughput_mbit": mbit * 1.2,
                "rtt_ms": ms, "rtt_p95_ms": ms * 1.5, "src_host": f"{a}1", "dst_host": f"{b}1",
                "src_addr": "198.18.1.2", "dst_addr": "198.18.2.2"}
    report = {"job": "bench-20261207-140000-24ff", "streams": 4, "duration_s": 5,
              "clusters": {n: {"intra": pair(n, n, 9400.0, 0.041)} for n in names},
              "pairs": [pair(a, b, 95.31, 52.31) for a in names for b in names if a != b]}
    text = draw(bench_matrix(report))
    uncut(text)
    for figure in ("9.4 Gbit/s TLS", "11.3 Gbit/s plain", "rtt 41 µs", "p95 62 µs",
                   "95.3 Mbit/s TLS", "114 Mbit/s plain", "rtt 52.3 ms", "p95 78.5 ms"):
        assert figure in text, (figure, text)  # a value and its unit on one line


def test_the_sync_advisors_grid_fits_80_columns() -> None:
    text = draw(advisor_table(advise(100_000_000, 0.2, 1000, 50)))
    uncut(text)
    assert "recommended: H = 100, codec int8 (95.4 % utilisation)" in text
    for codec, wan in (("none", 3.35), ("bf16", 1.75), ("int8", 0.96)):  # every column kept
        assert codec in text and f"(WAN {wan:.2f} s)" in text, (codec, text)


@pytest.mark.parametrize("stages, replicas", [(4, 4), (4, 8), (16, 12)])
def test_a_placement_of_many_replicas_fits_80_columns_one_pipeline_a_row(
        stages: int, replicas: int) -> None:
    """`nebula plan placement`: each replica's devices on its row, in stage order (a column per
    replica had cut the link costs to "0.0…" and split device names at 8 replicas)."""
    grid = [[f"east-gpu{j * replicas + r}" for r in range(replicas)] for j in range(stages)]
    placed = Placement(grid, [0.0123 * (j + 1) for j in range(stages - 1)],
                       [0.5 + j for j in range(stages)], Cost(3.21, 1.1, 1.05))
    text = draw(placement_table(PlacementResult(placed, 4000, 12.3, 4000, 0,
                                                {"random": 4.5, "local_search": 3.9},
                                                lower_bound=2.9)))
    uncut(text)
    flat = " ".join(text.replace("│", " ").split())
    for r in range(replicas):  # each pipeline whole, in order, wrapped between devices only
        assert f"r{r} " + " -> ".join(grid[j][r] for j in range(stages)) in flat, (r, text)
    assert f"{0.0123 * (stages - 1):.3f}" in text and "local search alone" in text
