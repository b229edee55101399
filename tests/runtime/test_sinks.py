"""The spec's `metrics:` sinks, end to end: launched jobs whose clusters' first ranks write
TensorBoard event files (read back with tensorboard's own reader, after `nebula logs` and
`nebula report` copied them here) and a W&B offline run (read with wandb's own reader, the
worker in a network namespace of its own: nothing can leave the machine); a missing library
is said once and training goes on; the section is typed, and only the writer gets it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.ds_plain import INNER, copy_example, edited, launched, records, spec_file
from helpers.jobs import CLI, write_spec

from nebula_cli.config import jobplan, plan_model, worlds
from nebula_cli.config.metrics_plan import METRICS_FILE
from nebula_cli.config.parts import METRICS_CONFIG_ENV, MetricsConfig
from nebula_cli.config.sections import WandbSpec
from nebula_cli.config.spec import parse_spec
from nebula_cli.errors import SpecError
from nebula_cli.transport.ssh.conn import SshConn

STEPS = 20
LOGGING = """
name: {name}
workdir: .
run: >-
  {wrap}python -c "import os; from nebula_cli.runtime import log;
  k = 2.0 if os.environ['NEBULA_CLUSTER'] == 'west' else 1.0;
  [log(step=i, loss=8.0 * k / i, note='text is not a scalar') for i in range(1, {steps} + 1)]"
metrics: {metrics}
env: {env}
clusters:
  - {{name: east, transport: local, hosts: [{{host: e1}}, {{host: e2}}]}}
  - {{name: west, transport: local, hosts: [{{host: w1}}]}}
"""


def expected_loss(cluster: str, step: int) -> float:
    return 8.0 * (2.0 if cluster == "west" else 1.0) / step


def launch(cli: CLI, tmp_path: Path, name: str, metrics: str, env: str = "{}",
           wrap: str = "") -> str:
    spec = write_spec(tmp_path, LOGGING.format(name=name, metrics=metrics, env=env, wrap=wrap,
                                               steps=STEPS))
    cli("launch", str(spec), check=True)  # the live view, until the job has ended
    (job_id,) = cli.job_ids()
    status = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert status["state"] == "SUCCEEDED", status
    return job_id


def test_tensorboard_runs_are_written_per_cluster_and_copied_by_logs_and_report(
        cli: CLI, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job_id = launch(cli, tmp_path, "tb", "{tensorboard: true}")
    job = cli.home / "jobs" / job_id  # local hosts keep their job directory here too
    on_hosts = sorted(p.relative_to(job) for p in job.glob("*/*/worker/tb/events.out.*"))
    assert [p.parts[:2] for p in on_hosts] == [("east", "e1"), ("west", "w1")]  # one writer
    assert not (job / "east" / "e2" / "worker" / METRICS_FILE).exists()

    logs = cli("logs", job_id, check=True)
    assert f"TensorBoard: 2 event file(s) in {job / 'tb'}" in logs.stderr
    copied = {p: p.stat().st_size for p in (job / "tb").glob("*/events.out.*")}
    assert sorted(p.parent.name for p in copied) == ["east", "west"]
    report = cli("report", job_id, check=True)
    assert f"tensorboard --logdir {job / 'tb'}" in " ".join(report.stdout.split())
    assert {p: p.stat().st_size for p in (job / "tb").glob("*/events.out.*")} == copied
    for cluster in ("east", "west"):
        run = EventAccumulator(str(job / "tb" / cluster))
        run.Reload()
        assert run.Tags()["scalars"] == ["loss"]  # numbers only, tags and text left out
        loss = run.Scalars("loss")
        assert [e.step for e in loss] == list(range(1, STEPS + 1))
        assert [e.value for e in loss] == pytest.approx(
            [expected_loss(cluster, s) for s in range(1, STEPS + 1)])


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run, read by wandb's own reader (no network)."""
    reader = [shutil.which("unshare") or "unshare", "--net",
              str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json",
              str(run_dir)]
    out = subprocess.run(reader, capture_output=True, text=True, timeout=120, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r for r in records if r["type"] in ("history", "run")]


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker runs in a network namespace of "
                    "its own (unshare --net needs root)")
def test_a_wandb_offline_run_holds_the_logged_loss_and_nothing_leaves_the_machine(
        cli: CLI, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    wandb_home = tmp_path / "wandb-home"  # W&B's config, cache and data: none in ~
    env = json.dumps({"WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(wandb_home / "config"),
                      "WANDB_CACHE_DIR": str(wandb_home / "cache"),
                      "WANDB_DATA_DIR": str(wandb_home / "data")})
    # every rank in a network namespace with no interface up: a try to go out would fail
    job_id = launch(cli, tmp_path, "wb", "{wandb: {project: nebula-test, mode: offline}}",
                    env=env, wrap="unshare --net ")
    job = cli.home / "jobs" / job_id
    for cluster, host in (("east", "e1"), ("west", "w1")):
        (run_dir,) = (job / cluster / host / "worker" / "wandb").glob("offline-run-*")
        rows = wandb_history(run_dir)
        (run,) = [r["run"] for r in rows if r["type"] == "run"]
        assert (run["project"], run["display_name"], run["run_group"]) == (
            "nebula-test", cluster, job_id)
        history = [r["history"] for r in rows if r["type"] == "history"]
        assert [h["step"]["num"] for h in history] == list(range(1, STEPS + 1))
        assert [h["item"]["loss"] for h in history] == pytest.approx(
            [expected_loss(cluster, s) for s in range(1, STEPS + 1)])
        assert all("note" not in h["item"] for h in history)
    assert not (job / "east" / "e2" / "worker" / "wandb").exists()  # one run per cluster


@pytest.mark.slow
def test_an_unmodified_deepspeed_script_gets_its_runs_with_the_end_of_training(
        cli: CLI, tmp_path: Path) -> None:
    """examples/ds_plain through the automatic hook: every loss record of each cluster's rank 0
    is in its TensorBoard run and its W&B run at the same step; the final records, written at
    the end of training (east: destroy_process_group; west: at exit, before W&B finishes its
    run), are in the W&B runs too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pytest.importorskip("wandb")
    work = copy_example(tmp_path)
    (work / "train_exit.py").write_text(edited((work / "train.py").read_text(),
                                               ("    dist.destroy_process_group()\n", "")))
    wandb_home = tmp_path / "wandb-home"
    spec = spec_file(tmp_path, "dsruns", {"east": ["e1", "e2"], "west": ["w1"]},
                     run="python -u $SCRIPT --steps 25",
                     metrics={"tensorboard": True,
                              "wandb": {"project": "nebula-test", "mode": "offline"}})
    data = yaml.safe_load(spec.read_text())
    data["env"].update(WANDB_MODE="offline", WANDB_CONFIG_DIR=str(wandb_home / "config"),
                       WANDB_CACHE_DIR=str(wandb_home / "cache"),
                       WANDB_DATA_DIR=str(wandb_home / "data"))
    data["clusters"][0]["env"] = {"SCRIPT": "train.py"}
    data["clusters"][1]["env"] = {"SCRIPT": "train_exit.py"}
    spec.write_text(yaml.safe_dump(data))
    job_id, _ = launched(cli, spec)
    job = cli.home / "jobs" / job_id
    cli("report", job_id, check=True)
    recs = [r for r in records(cli, job_id) if r["rank"] == 0]
    for cluster, host in (("east", "e1"), ("west", "w1")):
        mine = [r for r in recs if r["cluster"] == cluster]
        losses = {r["step"]: r["loss"] for r in mine if r.get("loss") is not None}
        assert len(losses) >= 25 // INNER + 1, losses
        run = EventAccumulator(str(job / "tb" / cluster))
        run.Reload()
        assert {e.step: e.value for e in run.Scalars("loss")} == pytest.approx(losses)
        (final,) = [r for r in mine if r.get("final")]
        (run_dir,) = (job / cluster / host / "worker" / "wandb").glob("offline-run-*")
        history = [r["history"] for r in wandb_history(run_dir) if r["type"] == "history"]
        logged = {h["step"]["num"]: h["item"] for h in history}
        assert {s: logged[s]["loss"] for s in losses} == pytest.approx(losses)
        assert logged[final["step"]]["last_loss"] == pytest.approx(final["last_loss"])
        assert logged[final["step"]]["outer_rounds"] == final["outer_rounds"] > 0


def test_a_missing_library_is_said_once_and_training_goes_on(cli: CLI, tmp_path: Path) -> None:
    missing = tmp_path / "no-wandb" / "wandb"  # what Python says when wandb is not installed
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wandb'\", name='wandb')\n")
    env = json.dumps({"PYTHONPATH": str(missing.parent)})
    job_id = launch(cli, tmp_path, "nowb",
                    "{tensorboard: true, wandb: {project: p, mode: offline}}", env=env)
    job = cli.home / "jobs" / job_id
    for cluster, host in (("east", "e1"), ("west", "w1")):
        log = (job / cluster / host / "worker" / "logs" / "rank0.log").read_text()
        said = [line for line in log.splitlines() if "wandb is not installed" in line]
        assert said == ["nebula: metrics: the spec asks for W&B, but wandb is not installed "
                        "on this host (pip install 'nebula-cli[wandb]' in the workers' "
                        "environment); training goes on without it"], log
        records = [json.loads(line) for line in
                   (job / cluster / host / "worker" / "metrics" / "rank0.jsonl").open()]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert list((job / cluster / host / "worker" / "tb").glob("events.out.*"))  # TB on


def test_the_metrics_section_is_typed_and_reaches_only_each_clusters_writer(
        tmp_path: Path) -> None:
    base = ("name: m\nrun: python t.py\nclusters:\n"
            "  - {name: east, transport: local, hosts: [{host: e1, slots: 2}, e2]}\n")
    for bad, words in (("metrics: {tensorbaord: true}", "did you mean 'tensorboard'"),
                       ("metrics: {wandb: {mode: offline}}", "metrics.wandb.project"),
                       ("metrics: {wandb: {project: p, mode: sometimes}}", "metrics.wandb.mode"),
                       ("metrics: {tensorboard: 'yes'}", "metrics.tensorboard")):
        with pytest.raises(SpecError) as caught:
            parse_spec(base + bad, base_dir=Path(__file__).parent)
        assert words in str(caught.value), (bad, str(caught.value))
    assert parse_spec(base, base_dir=Path(__file__).parent).metrics.wandb is None

    spec = parse_spec(base + "metrics: {tensorboard: true, wandb: {project: p}}",
                      base_dir=Path(__file__).parent)
    sites = {worlds.site_key(c, h): plan_model.Site(
        conn=SshConn(name=h.host, python="python3"), home="/home/u/.nebula", address=h.host,
        bind="0.0.0.0", python="/usr/bin/python3", shares_files=False)
        for c in spec.clusters for h in c.hosts}
    plan = jobplan.build_plan(spec, "job-1", sites=sites, certs=None,
                              ports=plan_model.Ports(masters={"east": 29500}, relays={}))
    first, second = plan.hosts
    root = "/home/u/.nebula/jobs/job-1/east/e1/worker"
    assert [METRICS_CONFIG_ENV in p.env for p in first.config.processes] == [True, False]
    assert METRICS_FILE not in second.files and second.tensorboard is None
    assert all(METRICS_CONFIG_ENV not in p.env for p in second.config.processes)
    path = Path(first.config.processes[0].env[METRICS_CONFIG_ENV])
    assert path == Path(root) / METRICS_FILE and first.tensorboard == f"{root}/tb"
    config = json.loads(first.files[METRICS_FILE])
    assert config["wandb"]["mode"] == WandbSpec.model_fields["mode"].default  # spec's default
    assert (config["wandb"]["name"], config["wandb"]["group"]) == ("east", "job-1")
    (tmp_path / METRICS_FILE).write_bytes(first.files[METRICS_FILE])
    loaded = MetricsConfig.load(tmp_path / METRICS_FILE)  # what the writer loads
    assert loaded.tensorboard_dir == f"{root}/tb" and loaded.wandb is not None


def test_a_sink_that_fails_is_named_once_and_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from nebula_cli.runtime import metrics
    from nebula_cli.runtime.sinks import Guarded

    class Broken:
        writes = 0

        def write(self, rec: object) -> None:
            Broken.writes += 1
            raise OSError("disk full")

        def close(self) -> None:
            raise AssertionError("a dropped sink is not closed")

    monkeypatch.setenv("NEBULA_METRICS_FILE", str(tmp_path / "m.jsonl"))
    monkeypatch.setattr(metrics._sinks, "optional", [Guarded("TensorBoard", Broken())])
    for step in (1, 2, 3):
        metrics.emit(step=step, loss=1.0 / step)
    assert Broken.writes == 1
    err = capsys.readouterr().err
    assert err == ("nebula: metrics: TensorBoard failed writing (OSError('disk full')); no more "
                   "records go there\n")
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").open()] == [1, 2, 3]
    metrics._close_optional()
