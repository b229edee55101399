"""nebula_cli.runtime.metrics: JSON-lines records, tagged stdout lines, tailing reads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.jobs import REPO

from nebula_cli.errors import NebulaError
from nebula_cli.runtime import METRICS_TAG, log, read_metrics
from nebula_cli.runtime.metrics import parse_line


def _strict(line: str) -> dict:
    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=no_constants)


@pytest.fixture
def metrics_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "deep" / "dir" / "metrics.jsonl"
    monkeypatch.setenv("NEBULA_METRICS_FILE", str(path))
    monkeypatch.setenv("NEBULA_CLUSTER", "east")
    monkeypatch.setenv("NEBULA_HOST", "gpu-3")
    monkeypatch.setenv("RANK", "2")
    return path


def test_log_writes_tagged_lines(metrics_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = log(step=7, loss=2.5, tokens_per_s=1234.5, note="warm")
    log(step=8, loss=2.25)

    lines = metrics_env.read_text().splitlines()
    assert len(lines) == 2
    first = _strict(lines[0])
    assert first == rec
    assert first["step"] == 7 and first["loss"] == 2.5 and first["note"] == "warm"
    assert (first["cluster"], first["host"], first["rank"]) == ("east", "gpu-3", 2)
    assert isinstance(first["ts"], float) and first["ts"] > 1.6e9
    assert _strict(lines[1])["step"] == 8

    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(METRICS_TAG + " ")
    assert _strict(out[0][len(METRICS_TAG) + 1 :]) == first
    assert parse_line(out[1]) == _strict(lines[1])


def test_non_finite_floats_become_null(metrics_env: Path) -> None:
    rec = log(
        step=1,
        loss=float("nan"),
        up=float("inf"),
        down=-float("inf"),
        ok=0.5,
        nested={"a": float("nan"), "b": [1.0, float("inf")]},
    )
    assert rec["loss"] is None and rec["up"] is None and rec["down"] is None
    stored = _strict(metrics_env.read_text())
    assert stored["loss"] is None and stored["up"] is None and stored["ok"] == 0.5
    assert stored["nested"] == {"a": None, "b": [1.0, None]}


def test_item_scalars_are_unwrapped(metrics_env: Path) -> None:
    class Scalar:  # stands in for a 0-d tensor without importing torch
        def item(self) -> float:
            return 3.5

    assert log(step=2, loss=Scalar())["loss"] == 3.5
    assert _strict(metrics_env.read_text())["loss"] == 3.5


def test_without_metrics_file_only_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NEBULA_METRICS_FILE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    rec = log(step=3, loss=1.0)
    assert rec["rank"] is None and rec["cluster"] is None
    assert list(tmp_path.iterdir()) == []
    assert parse_line(capsys.readouterr().out) == rec


def test_reserved_names_are_refused(metrics_env: Path) -> None:
    with pytest.raises(NebulaError, match="reserved"):
        log(step=1, host="other")
    assert not metrics_env.exists()


def test_read_metrics_offsets_and_partial_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert read_metrics(path) == ([], 0)  # not there yet

    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    recs, offset = read_metrics(path)
    assert [r["step"] for r in recs] == [1]
    assert offset == len('{"step": 1, "loss": 3.0}\n')

    again, same = read_metrics(path, offset)  # the partial line stays unread
    assert again == [] and same == offset

    with open(path, "a") as f:
        f.write('ss": 2.5}\nnot json at all\n[1, 2]\n\n{"step": 3}\n{"step"')
    recs, offset2 = read_metrics(path, offset)
    assert recs == [{"step": 2, "loss": 2.5}, {"step": 3}]
    assert offset2 == path.stat().st_size - len('{"step"')

    path.write_text('{"step": 9}\n')  # replaced by a shorter file: read from the start
    recs, offset3 = read_metrics(path, offset2)
    assert recs == [{"step": 9}] and offset3 == path.stat().st_size


def test_read_metrics_follows_log(metrics_env: Path) -> None:
    offset = 0
    seen = []
    for step in range(5):
        log(step=step, loss=float(step))
        recs, offset = read_metrics(metrics_env, offset)
        seen.extend(r["step"] for r in recs)
    assert seen == [0, 1, 2, 3, 4]


def test_parse_line_picks_tagged_lines_out_of_logs() -> None:
    line = f'[east/gpu-3/0] {METRICS_TAG} {{"step": 4, "loss": 1.5}}'
    assert parse_line(line) == {"step": 4, "loss": 1.5}
    assert parse_line("epoch 3 done") is None
    assert parse_line(f"{METRICS_TAG} {{broken") is None


def test_concurrent_writers_keep_lines_whole(metrics_env: Path) -> None:
    def writer(k: int) -> None:
        for i in range(100):
            log(step=i, writer=k, pad="x" * 500)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    recs, _ = read_metrics(metrics_env)
    assert len(recs) == 400
    assert sorted((r["writer"], r["step"]) for r in recs) == [
        (k, i) for k in range(4) for i in range(100)
    ]


def test_import_is_light() -> None:
    code = (
        "import sys, nebula_cli.runtime as r; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'nebula_cli.runtime.sync' not in sys.modules; print(r.METRICS_TAG)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == METRICS_TAG
