"""Cheap reads on a long job (issue 10, section 7): `status` answers from the agents' metric
summaries, `logs --tail` reads only the ends of logs, an unreachable host is reported and
skipped, and what is read does not grow with the files."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers.jobs import REPO

from nebula_cli.agent import summary
from nebula_cli.cli.ui import human_bytes
from nebula_cli.control import summaries
from nebula_cli.control.follow import (
    LineTail,
    LogFollower,
    MetricsFollower,
    Reachability,
    file_sizes,
    probe_size,
)
from nebula_cli.control.jobs import JobOps
from nebula_cli.control.session import Session
from nebula_cli.control.state import HostRecord, StateStore
from nebula_cli.transport import LocalTransport, Transport
from nebula_cli.transport.base import CommandResult

MILLION = 1_000_000


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_status_reads",
                                                  REPO / "bench" / "status_reads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


class CountingTransport(LocalTransport):
    """The local transport, counting the bytes that reach this side (command output and file
    reads): what an SSH transport would carry over the network."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bytes_in = 0
        self.reads: list[tuple[str, int]] = []

    def run(self, argv: Any, **kwargs: Any) -> CommandResult:  # type: ignore[override]
        result = super().run(argv, **kwargs)
        self.bytes_in += len(result.stdout) + len(result.stderr)
        return result

    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20
                  ) -> tuple[bytes, int]:
        data, end = super().read_tail(remote, offset, max_bytes)
        self.bytes_in += len(data)
        self.reads.append((remote, len(data)))
        return data, end


def counting(home: Path) -> CountingTransport:
    return CountingTransport("e1", home=str(home), python=sys.executable)


class CountingSession(Session):
    """A Session whose every host goes through one counting transport."""

    def __init__(self, store: StateStore, transport: CountingTransport) -> None:
        super().__init__(store)
        self.counter = transport

    def transport(self, conn: Any) -> Transport:
        return self.counter


class CountingOps(JobOps):
    """JobOps through a CountingSession."""

    def __init__(self, store: StateStore, transport: CountingTransport) -> None:
        super().__init__(CountingSession(store, transport))
        self.counter = transport


def nebula(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NEBULA_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "nebula_cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def big_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running job whose worker and relay metrics files (and logs) hold 1,000,000 lines."""
    with bench.recorded_job(tmp_path_factory.mktemp("big") / "home", MILLION) as job:
        yield job


@pytest.fixture
def small_job(tmp_path: Path) -> Iterator[Any]:
    with bench.recorded_job(tmp_path / "home", 10) as job:
        yield job


def status_bytes(job: Any) -> tuple[int, list[tuple[str, int]], summaries.MetricsView]:
    """Bytes that reach the CLI for `status JOB` (refresh + metrics), reads of files, figures."""
    transport = counting(job.home)
    with StateStore(job.home) as store:
        ops = CountingOps(store, transport)
        snap = ops.refresh(job.job_id)
        view = ops.metrics_view(snap)
    return transport.bytes_in, transport.reads, view


# -- the agent's summary ------------------------------------------------------------------------
@pytest.mark.slow  # makes files of 1,000,000 lines
def test_summary_of_a_million_records_reads_a_bounded_tail(big_job: Any) -> None:
    worker = big_job.dirs[0]
    assert (worker / "metrics" / "rank0.jsonl").stat().st_size > 50 * summary.SCAN_BYTES
    (worker / summary.SUMMARY_FILE).unlink(missing_ok=True)
    first = summary.summarize_dir(worker)["0"]
    assert 0 < first["read"] <= summary.SCAN_BYTES
    last = bench.worker_record(MILLION - 1)
    newest_eval = bench.worker_record(MILLION - 100)
    newest_sync = bench.worker_record(MILLION - 50)
    assert first["latest"]["step"] == MILLION - 1
    assert first["latest"]["loss"] == last["loss"]
    assert first["latest"]["tokens_per_s"] == last["tokens_per_s"]
    assert first["latest"]["eval_loss"] == newest_eval["eval_loss"]
    assert first["latest"]["outer_round"] == newest_sync["outer_round"]
    assert first["latest"]["wan_bytes_sent"] == newest_sync["wan_bytes_sent"]

    again = summary.summarize_dir(worker)["0"]  # kept in metrics-summary.json: nothing new
    assert again["read"] == 0 and again["latest"] == first["latest"]
    assert (worker / summary.SUMMARY_FILE).stat().st_size < 16 << 10


def test_summary_folds_new_records_finals_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "rank0.jsonl"
    bench.write_lines(path, 10, bench.worker_line)
    first = summary.summarize_dir(tmp_path)["0"]
    assert first["latest"]["step"] == 9 and first["final"] is None
    with open(path, "a") as fh:
        fh.write("not json\n[1, 2]\n")
        fh.write(json.dumps({"step": 10, "loss": 1.5, "huge": "x" * 5000}) + "\n")
        fh.write(json.dumps({"step": 11, "final": True, "eval_loss": 1.25, "last_loss": 1.4,
                             "rank": 0}) + "\n")
        fh.write('{"step": 12, "loss": 1.')  # a record still being written
    added = summary.summarize_dir(tmp_path)["0"]
    assert added["read"] == path.stat().st_size - first["offset"]  # only the new bytes
    latest = added["latest"]
    assert latest["loss"] == 1.5 and "huge" not in latest
    assert latest["step"] == 11 and latest["eval_loss"] == 1.25  # what a final record carries
    assert "last_loss" not in latest and added["final"]["last_loss"] == 1.4
    with open(path, "a") as fh:
        fh.write('0}\n')
    assert summary.summarize_dir(tmp_path)["0"]["latest"]["loss"] == 1.0

    bench.write_lines(path, 3, bench.worker_line)  # replaced by a shorter file
    fresh = summary.summarize_dir(tmp_path)["0"]
    assert fresh["latest"]["step"] == 2 and fresh["final"] is None


def test_agent_status_answers_with_metrics(small_job: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "nebula_cli.agent", "status",
                           *map(str, small_job.dirs)], capture_output=True, text=True,
                          timeout=60, check=True)
    worker, relay = json.loads(proc.stdout)
    assert worker["state"] == "RUNNING"
    assert worker["metrics"]["0"]["file"] == "metrics/rank0.jsonl"
    assert worker["metrics"]["0"]["latest"]["step"] == 9
    assert relay["metrics"]["relay"]["latest"]["bytes_sent_total"] == 9000
    assert "metrics" not in json.loads((small_job.dirs[0] / "status.json").read_text())


# -- status: bounded, and the same figures ------------------------------------------------------
@pytest.mark.slow  # makes files of 1,000,000 lines
def test_status_reads_do_not_grow_with_the_metrics_files(big_job: Any, small_job: Any) -> None:
    for job in (big_job, small_job):
        for d in job.dirs:
            (d / summary.SUMMARY_FILE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    big_in, big_reads, big_view = status_bytes(big_job)
    big_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    small_in, small_reads, small_view = status_bytes(small_job)
    small_s = time.perf_counter() - t0
    print(f"status: {big_s:.3f} s (1,000,000 records) vs {small_s:.3f} s (10 records); "
          f"{big_in} vs {small_in} bytes to the CLI")
    assert big_reads == [] and small_reads == []  # no metrics file read over the transport
    assert big_in < small_in + 1024  # only the summary's numbers are longer
    assert big_view.latest["east"]["step"] == MILLION - 1
    assert big_view.relay["east"]["bytes_sent_total"] == (MILLION - 1) * 1000
    assert small_view.latest["east"]["step"] == 9


@pytest.mark.slow  # makes files of 1,000,000 lines
def test_status_command_shows_the_newest_figures(big_job: Any) -> None:
    shown = json.loads(nebula(big_job.home, "status", big_job.job_id, "--json").stdout)
    last, sync = bench.worker_record(MILLION - 1), bench.worker_record(MILLION - 50)
    east = shown["metrics"]["east"]
    assert (east["step"], east["loss"], east["tokens_per_s"]) == (
        last["step"], last["loss"], last["tokens_per_s"])
    assert (east["outer_round"], east["wan_bytes_sent"]) == (sync["outer_round"],
                                                             sync["wan_bytes_sent"])
    assert shown["relays"]["east"]["round"] == MILLION - 1
    text = nebula(big_job.home, "status", big_job.job_id).stdout
    assert str(MILLION - 1) in text  # the step, and the relay's WAN bytes in MB/GB
    assert human_bytes((MILLION - 1) * 1000) in text and "RUNNING" in text


def test_an_ended_job_shows_its_figures_without_its_hosts(tmp_path: Path) -> None:
    with bench.recorded_job(tmp_path / "home", 10, running=False) as job:
        first = json.loads(nebula(job.home, "status", job.job_id, "--json").stdout)
        assert first["state"] == "SUCCEEDED" and first["metrics"]["east"]["step"] == 9
        for d in job.dirs:  # the hosts are gone: the kept summaries still answer
            for p in sorted(d.rglob("*"), reverse=True):
                p.rmdir() if p.is_dir() else p.unlink()
        again = json.loads(nebula(job.home, "status", job.job_id, "--json").stdout)
        assert again["metrics"] == first["metrics"] and again["relays"] == first["relays"]


@pytest.mark.slow  # makes files of 1,000,000 lines
def test_without_agent_summaries_the_tails_are_read(big_job: Any) -> None:
    """An agent from before summaries: the CLI reads each file's tail, at most SCAN_BYTES."""
    transport = counting(big_job.home)
    with StateStore(big_job.home) as store:
        rec = next(h for h in store.hosts(big_job.job_id) if h.role == "worker")
    ranks = summaries.read_summaries(transport, rec)
    assert ranks["0"]["latest"]["step"] == MILLION - 1
    assert sum(n for _, n in transport.reads) <= summary.SCAN_BYTES


def test_file_sizes_by_command_and_by_probing(tmp_path: Path) -> None:
    sizes = {"empty": 0, "one": 1, "odd": 12345, "big": 3 << 20}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    paths = [str(tmp_path / n) for n in sizes] + [str(tmp_path / "missing")]
    transport = LocalTransport("e1", home=str(tmp_path), python=sys.executable)
    assert file_sizes(transport, paths) == {**{str(tmp_path / n): s for n, s in sizes.items()},
                                            str(tmp_path / "missing"): None}
    assert {p: probe_size(transport, p) for p in paths} == file_sizes(transport, paths)
    failing = LocalTransport("e1", home=str(tmp_path), python="false")  # exits 1, as a host
    assert file_sizes(failing, paths) == file_sizes(transport, paths)  # without python would


# -- logs ---------------------------------------------------------------------------------------
@pytest.mark.slow  # makes files of 1,000,000 lines
def test_logs_tail_reads_only_the_end(big_job: Any) -> None:
    transport = counting(big_job.home)
    with StateStore(big_job.home) as store:
        hosts = store.hosts(big_job.job_id)
    follower = LogFollower(hosts, lambda rec: transport, rank="0", tail=3)
    lines = follower.poll(final=True)
    assert [ln.text for ln in lines] == [bench.log_line(i) for i in range(MILLION - 3, MILLION)]
    assert sum(n for _, n in transport.reads) <= 64 << 10
    out = nebula(big_job.home, "logs", big_job.job_id, "--tail", "2")
    assert out.returncode == 0 and out.stdout.count("\n") == 4  # 2 lines of 2 processes
    assert "east/e1/0 | " in out.stdout and f"step {MILLION - 1} of" in out.stdout


def test_line_tail_edges(tmp_path: Path) -> None:
    transport = LocalTransport("e1", home=str(tmp_path), python=sys.executable)
    path = tmp_path / "a.log"
    path.write_bytes(b"one\ntwo\nthree\nfour (still being written)")
    lt = LineTail(transport, str(path), last=2)
    assert lt.read_lines() == ["two", "three"]
    with open(path, "ab") as fh:
        fh.write(b" done\nfive\n")
    assert lt.read_lines() == ["four (still being written) done", "five"]
    assert LineTail(transport, str(path), last=50).read_lines() == [
        "one", "two", "three", "four (still being written) done", "five"]
    assert LineTail(transport, str(path), last=0).read_lines() == []
    missing = LineTail(transport, str(tmp_path / "later.log"), last=5)
    assert missing.read_lines() == []
    (tmp_path / "later.log").write_text("a\nb\n")
    assert missing.read_lines() == ["a", "b"]  # a log that appears later is read whole


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_unreachable_host(home: Path, job_id: str) -> None:
    """A host of the job behind an SSH port on loopback that nothing listens on."""
    conn = {"transport": "ssh", "name": "w1", "host": "127.0.0.1", "port": closed_port(),
            "user": "nobody", "python": "python3", "known_hosts": str(home / "known_hosts"),
            "connect_timeout": 3}
    with StateStore(home) as store:
        store.upsert_host(HostRecord(
            job_id=job_id, cluster="west", host="w1", role="worker", node_rank=0, slots=1,
            agent_dir="/nonexistent/agent", state="RUNNING",
            detail={"conn": conn, "logs": {"0": "logs/rank0.log"},
                    "metrics": {"0": "metrics/rank0.jsonl"}}))


def test_an_unreachable_host_is_reported_and_skipped(small_job: Any) -> None:
    add_unreachable_host(small_job.home, small_job.job_id)
    out = nebula(small_job.home, "logs", small_job.job_id, "--tail", "1")
    assert out.returncode == 0, out.stderr
    assert "east/e1/0 | " in out.stdout and "west/w1" not in out.stdout
    assert "warning:" in out.stderr and "west/w1" in out.stderr
    assert "Traceback" not in out.stderr
    only = nebula(small_job.home, "logs", small_job.job_id, "--host", "w1")
    assert only.returncode == 1 and "west/w1" in only.stderr
    status = nebula(small_job.home, "status", small_job.job_id, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["metrics"]["east"]["step"] == 9


def test_following_a_host_that_goes_away_reports_it_once(tmp_path: Path) -> None:
    now = [0.0]
    agent_dir = tmp_path / "agent"
    log = agent_dir / "logs" / "rank0.log"
    log.parent.mkdir(parents=True)
    log.write_text("first\n")
    conn = {"transport": "local", "name": "e1", "home": str(tmp_path), "python": sys.executable}
    rec = HostRecord(job_id="j", cluster="east", host="e1", role="worker", node_rank=0,
                     slots=1, agent_dir=str(agent_dir), state="RUNNING",
                     detail={"conn": conn, "logs": {"0": "logs/rank0.log"}})
    transport = LocalTransport("e1", home=str(tmp_path), python=sys.executable)
    follower = LogFollower([rec], lambda r: transport)
    follower.reach = Reachability(clock=lambda: now[0])
    assert [ln.text for ln in follower.poll()] == ["first"]
    log.parent.rename(tmp_path / "away")
    log.parent.write_text("")  # a file where the directory was: reads fail as a lost host's
    for _ in range(5):
        assert follower.poll() == []
        now[0] += 1000
    problems = follower.reach.take()
    assert len(problems) == 1 and problems[0].startswith("east/e1: ")
    log.parent.unlink()
    (tmp_path / "away").rename(log.parent)
    with open(log, "a") as fh:
        fh.write("second\n")
    assert [ln.text for ln in follower.poll()] == ["second"]
    assert follower.reach.take() == ["east/e1: reachable again"]


def test_reachability_backs_off() -> None:
    now = [0.0]
    reach = Reachability(clock=lambda: now[0])
    reach.failed("a/b", RuntimeError("gone"))
    assert not reach.due("a/b")
    now[0] += 5.0
    assert reach.due("a/b")
    reach.failed("a/b", RuntimeError("gone"))
    now[0] += 5.0
    assert not reach.due("a/b")  # the pause doubled
    assert reach.take() == ["a/b: gone (skipped; retrying)"] and reach.down == ["a/b"]


# -- the live view's follower ---------------------------------------------------------------------
@pytest.mark.slow  # makes files of 1,000,000 lines
def test_metrics_follower_starts_at_the_tail_and_keeps_bounded_history(big_job: Any) -> None:
    transport = counting(big_job.home)
    with StateStore(big_job.home) as store:
        hosts = store.hosts(big_job.job_id)
    follower = MetricsFollower(hosts, lambda rec: transport, history=100)
    follower.poll()
    assert sum(n for _, n in transport.reads) <= 2 * summary.SCAN_BYTES
    assert follower.latest["east"]["step"] == MILLION - 1
    assert follower.relay["east"]["round"] == MILLION - 1
    assert len(follower.history["east"]) == 100
    metrics = next(d for d in big_job.dirs if d.name.endswith("worker")) / "metrics/rank0.jsonl"
    size = metrics.stat().st_size
    try:
        with open(metrics, "a") as fh:
            for i in range(MILLION, MILLION + 300):
                fh.write(bench.worker_line(i) + "\n")
            fh.write(json.dumps({"step": MILLION + 300, "final": True, "rank": 0}) + "\n")
            fh.write(json.dumps({"step": MILLION + 301, "final": True, "rank": 0}) + "\n")
        follower.poll()
    finally:
        os.truncate(metrics, size)  # the module's other tests see the file as made
    assert len(follower.history["east"]) == 100
    assert follower.history["east"][-1]["step"] == MILLION + 299
    assert [f["step"] for f in follower.finals] == [MILLION + 301]  # one per rank
