"""Readers across rotated files (control/follow.py, control/summaries.py, agent/summary.py):
a follower of a log or a metrics file that rotates under it reads every line once, in order;
`--tail` reaches into the rotated file; summaries keep the newest values across a rotation and
start anew only for a file replaced otherwise. Real files, a real LocalTransport."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from nebula_cli.agent import summary
from nebula_cli.config.rotation import Rotation, append
from nebula_cli.control.follow import LineTail
from nebula_cli.control.state import ROTATED_KEY, HostRecord
from nebula_cli.control.summaries import read_summaries
from nebula_cli.transport import LocalTransport


def _transport(tmp_path: Path) -> LocalTransport:
    return LocalTransport("e1", home=str(tmp_path), python=sys.executable)


def test_a_follower_reads_every_line_once_across_rotations(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "rank0.log"
    rotation = Rotation(max_bytes=2000, keep=1)  # the follower needs only the newest rotated
    append(path, b"before the follower\n", rotation)
    tail = LineTail(_transport(tmp_path), str(path), last=0)
    assert tail.read_lines() == []
    written, got = [], []
    for i in range(3000):
        line = f"line {i} " + "z" * (i % 30)
        written.append(line)
        data = (line + "\n").encode()
        if i % 5 == 4:  # the pump writes what it read: sometimes half a line
            append(path, data[:7], rotation)
            append(path, data[7:], rotation)
        else:
            append(path, data, rotation)
        if i % 37 == 0:  # polls now and then (at least once per max_bytes written)
            got += tail.read_lines()
    got += tail.read_lines(final=True)
    assert got == written
    assert Path(f"{path}.1").exists()


def test_tail_reaches_into_the_rotated_file(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    rotation = Rotation(max_bytes=1000, keep=3)
    for i in range(200):
        append(path, f"line {i:04d} of the run\n".encode(), rotation)
    live = path.read_text().splitlines()
    assert 0 < len(live) < 40  # it rotated a moment ago: the live log holds few lines
    tail = LineTail(_transport(tmp_path), str(path), last=40)
    assert tail.read_lines() == [f"line {i:04d} of the run" for i in range(160, 200)]
    append(path, b"after\n", rotation)
    assert tail.read_lines() == ["after"]


def _job_host(tmp_path: Path) -> HostRecord:
    return HostRecord(job_id="j", cluster="east", host="e1", role="worker", node_rank=0,
                      slots=1, agent_dir=str(tmp_path), state="RUNNING",
                      detail={"conn": {"transport": "local", "name": "e1"},
                              "metrics": {"0": "metrics/rank0.jsonl"}, ROTATED_KEY: 2})


def test_summaries_keep_the_newest_values_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "rank0.jsonl"
    rotation = Rotation(max_bytes=4000, keep=2)

    def rec(**values: object) -> bytes:
        return (json.dumps(values) + "\n").encode()

    append(path, rec(step=0, eval_loss=3.0), rotation)  # logged once, early
    first = summary.summarize_dir(tmp_path)["0"]
    assert first["latest"]["eval_loss"] == 3.0
    step = 1
    while not Path(f"{path}.1").exists():
        append(path, rec(step=step, loss=1 / step), rotation)
        step += 1
    append(path, rec(step=step, loss=0.5), rotation)
    after = summary.summarize_dir(tmp_path)["0"]  # the agent's status, the next time
    assert after["latest"]["step"] == step and after["latest"]["eval_loss"] == 3.0
    remote = read_summaries(_transport(tmp_path), _job_host(tmp_path))["0"]  # over a transport
    assert remote["latest"]["step"] == step and remote["latest"]["loss"] == 0.5
    assert "step" in remote["latest"] and remote["read"] <= summary.SCAN_BYTES

    path.write_text(json.dumps({"step": 1}) + "\n")  # replaced otherwise: a new summary
    fresh = summary.summarize_dir(tmp_path)["0"]
    assert fresh["latest"] == {"step": 1}
