"""Pipeline parallelism across clusters: placement checks, the rank each device gets, the spec
fields, the env the launcher hands every rank, and a pipelined job run end to end on this
machine (the test bed run is in test_ssh_launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers.jobs import CLI, REPO
from rich.console import Console

from nebula_cli.cli.ui import final_summary
from nebula_cli.config import jobplan, plan_model, worlds
from nebula_cli.config.pipeline import (
    PlacementError,
    default_layout,
    device_id,
    layout_from_placement,
    read_placement,
)
from nebula_cli.config.spec import parse_spec
from nebula_cli.control.final_parameters import verdict
from nebula_cli.errors import SpecError
from nebula_cli.transport.ssh.conn import SshConn

DEVICES = ["east/e1/0", "east/e1/1", "west/w1/0", "west/w1/1"]
CROSSED = {"stages": [["east/e1/0", "west/w1/1"], ["west/w1/0", "east/e1/1"]]}


def test_deepspeed_topology_rank_is_stage_times_replicas_plus_replica() -> None:
    layout = layout_from_placement(CROSSED, DEVICES, 2)
    assert layout.ranks() == {"east/e1/0": 0, "west/w1/1": 1, "west/w1/0": 2, "east/e1/1": 3}
    assert layout.position("east/e1/1") == (1, 1)
    assert (layout.num_stages, layout.replicas, layout.world_size) == (2, 2, 4)
    # DeepSpeed's own topology agrees: the coordinate of each rank is (pipe, data)
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    for device, rank in layout.ranks().items():
        coord = topo.get_coord(rank)
        assert (coord.pipe, coord.data) == layout.position(device)


def test_default_layout_keeps_the_host_order() -> None:
    layout = default_layout(DEVICES, 2)
    assert layout.stages == [DEVICES[:2], DEVICES[2:]]
    assert [layout.rank_of(d) for d in DEVICES] == [0, 1, 2, 3]
    assert default_layout(DEVICES, 4).stages == [[d] for d in DEVICES]
    assert device_id("east", "e1", 1) == "east/e1/1"


@pytest.mark.parametrize(("placement", "stages", "message"), [
    ({"stages": [DEVICES]}, 2, "has 1 stages, the spec asks for pipeline_stages: 2"),
    ({"stages": [DEVICES[:3], DEVICES[3:]]}, 2, "stage 0 of the placement has 3 devices"),
    ({"stages": [DEVICES[:2], [DEVICES[2], DEVICES[2]]]}, 2, "placed more than once: west/w1/0"),
    ({"stages": [DEVICES[:2], [DEVICES[2], "west/w9/0"]]}, 2, "not in this job: west/w9/0"),
    ({"stages": [DEVICES[:2], [DEVICES[2], 7]]}, 2, "device ids are strings, found 7"),
    ({"groups": []}, 2, "expected 'stages'"),
    ({"stages": [DEVICES]}, 3, "cannot form 3 pipeline stages"),
])
def test_placements_that_do_not_fit_are_refused(placement: dict, stages: int,
                                                message: str) -> None:
    with pytest.raises(PlacementError, match=message.replace("(", r"\(")):
        layout_from_placement(placement, DEVICES, stages)


def test_read_placement_errors(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="cannot read the placement: no such file"):
        read_placement(tmp_path / "missing.json")
    with (tmp_path / "huge.json").open("wb") as fh:  # bounded: never read whole
        fh.truncate(64 << 20)
    with pytest.raises(PlacementError, match="placement"):
        read_placement(tmp_path / "huge.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlacementError, match="not valid JSON"):
        read_placement(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(PlacementError, match="expected a JSON object"):
        read_placement(tmp_path / "list.json")


def spec_text(extra: str = "", slots: int = 2, cleartext: bool = True) -> str:
    """Two clusters; a pipeline across them accepts the clear-text WAN unless told not to."""
    if cleartext:
        extra = extra.replace("parallelism: {", "parallelism: {cleartext_wan: true, ")
    return f"""
name: pipe
run: python train_pipe.py
{extra}
clusters:
  - {{name: east, hosts: [{{host: e1, slots: {slots}}}]}}
  - {{name: west, hosts: [{{host: w1, slots: {slots}}}]}}
"""


def test_spec_reads_the_placement_relative_to_the_spec_file(tmp_path: Path) -> None:
    (tmp_path / "place.json").write_text(json.dumps(CROSSED))
    spec = parse_spec(spec_text("parallelism: {pipeline_stages: 2}\nplacement: place.json"),
                      file=str(tmp_path / "job.yaml"))
    assert spec.placement == str(tmp_path / "place.json")
    assert spec.pipeline_stages == 2
    assert spec.device_ids() == DEVICES
    assert spec.pipeline_layout().stages == CROSSED["stages"]
    plain = parse_spec(spec_text(), file=str(tmp_path / "job.yaml"))
    assert plain.pipeline_stages == 1 and plain.pipeline_layout() is None


@pytest.mark.parametrize(("extra", "field", "message"), [
    ("placement: place.json", "placement", "needs parallelism: {pipeline_stages: K}"),
    ("parallelism: {pipeline_stages: 2}\nrelay: {}", "relay", "does not use the relay"),
    ("parallelism: {pipeline_stages: 3}", "parallelism.pipeline_stages",
     "4 devices (slots over all hosts) cannot form 3 pipeline stages"),
    ("parallelism: {pipeline_stages: 4}\nplacement: place.json", "placement",
     "has 2 stages, the spec asks for pipeline_stages: 4"),
    ("parallelism: {pipeline_stages: 2}\nplacement: nowhere.json", "placement",
     "cannot read the placement"),
    ("parallelism: {pipeline_stages: 0}", "parallelism.pipeline_stages",
     "expected an integer >= 1, found 0"),
])
def test_spec_errors_name_the_field(tmp_path: Path, extra: str, field: str,
                                    message: str) -> None:
    (tmp_path / "place.json").write_text(json.dumps(CROSSED))
    with pytest.raises(SpecError) as info:
        parse_spec(spec_text(extra), file=str(tmp_path / "job.yaml"))
    problems = info.value.problems
    assert any(p.field == field and message in p.message for p in problems), problems


def test_a_pipeline_across_clusters_needs_cleartext_wan(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec_text("parallelism: {pipeline_stages: 2}", cleartext=False),
                   file=str(tmp_path / "j.yaml"))
    (p,) = info.value.problems
    assert p.field == "parallelism" and "east, west" in p.message
    assert "unencrypted" in p.message and "cleartext_wan: true" in p.message
    allowed = parse_spec(spec_text("parallelism: {pipeline_stages: 2}"),
                         file=str(tmp_path / "j.yaml"))
    warning = allowed.cleartext_warning()
    assert warning is not None and "east, west" in warning and "unencrypted" in warning
    one_cluster = spec_text("parallelism: {pipeline_stages: 2}", cleartext=False).replace(
        "  - {name: west, hosts: [{host: w1, slots: 2}]}\n", "")
    inside = parse_spec(one_cluster, file=str(tmp_path / "j.yaml"))
    assert inside.pipeline_stages == 2 and inside.cleartext_warning() is None
    assert parse_spec(spec_text(), file=str(tmp_path / "j.yaml")).cleartext_warning() is None


def test_plan_workers_gives_every_rank_its_placed_position(tmp_path: Path) -> None:
    (tmp_path / "place.json").write_text(json.dumps(CROSSED))
    spec = parse_spec(spec_text("parallelism: {pipeline_stages: 2}\nplacement: place.json"),
                      file=str(tmp_path / "job.yaml"))
    sites = {"east/e1": _site("/h/east", "198.18.1.1"),
             "west/w1": _site("/h/west", "198.18.2.1")}
    assert worlds.rendezvous_hosts(spec) == {
        worlds.PIPELINE_WORLD: (spec.clusters[0], spec.clusters[0].hosts[0])}
    plans = jobplan.build_plan(spec, "job1", sites=sites, certs=None, ports=plan_model.Ports(
        masters={worlds.PIPELINE_WORLD: 29555}, relays={})).agents
    envs = {p.env["NEBULA_DEVICE"]: p.env for plan in plans for p in plan.config.processes}
    assert set(envs) == set(DEVICES)
    for device, env in envs.items():
        stage, replica = (int(env["NEBULA_STAGE"]), int(env["NEBULA_REPLICA"]))
        assert CROSSED["stages"][stage][replica] == device
        assert env["RANK"] == str(stage * 2 + replica)
        assert env["WORLD_SIZE"] == "4" and env["NEBULA_PIPELINE_STAGES"] == "2"
        assert env["MASTER_ADDR"] == "198.18.1.1" and env["MASTER_PORT"] == "29555"
        assert env["LOCAL_RANK"] == device.rsplit("/", 1)[1]
    assert [p.name for p in plans[1].config.processes] == ["2", "1"]
    assert plans[1].logs == {"2": "logs/rank2.log", "1": "logs/rank1.log"}


def test_data_parallel_jobs_keep_one_world_per_cluster(tmp_path: Path) -> None:
    spec = parse_spec(spec_text(), file=str(tmp_path / "job.yaml"))
    sites = {"east/e1": _site("/h", "a"), "west/w1": _site("/h", "b")}
    plans = jobplan.build_plan(spec, "job1", sites=sites, certs=None, ports=plan_model.Ports(
        masters={"east": 1, "west": 2}, relays={})).agents
    for plan, (addr, port) in zip(plans, [("a", "1"), ("b", "2")], strict=True):
        for p in plan.config.processes:
            assert (p.env["MASTER_ADDR"], p.env["MASTER_PORT"]) == (addr, port)
            assert p.env["WORLD_SIZE"] == "2" and "NEBULA_STAGE" not in p.env
        assert [p.name for p in plan.config.processes] == ["0", "1"]


def _site(home: str, address: str) -> plan_model.Site:
    """A remote host as its transport would report it."""
    return plan_model.Site(conn=SshConn(name=address, python="python3"), home=home, address=address,
                        bind="0.0.0.0", python="python3", shares_files=False)


def test_summary_checks_each_stage_replicas() -> None:
    def fin(stage: int, replica: int, sha: str) -> dict:
        return {"cluster": "east", "host": "e1", "rank": stage * 2 + replica, "stage": stage,
                "replica": replica, "param_sha256": sha}

    def text(finals: list[dict]) -> str:
        console = Console(record=True, width=200)
        console.print(final_summary(finals, ["east"], verdict(finals, frozenset())))
        return console.export_text()

    same = [fin(0, 0, "a"), fin(0, 1, "a"), fin(1, 0, "b"), fin(1, 1, "b")]
    assert "each stage's replicas hold identical parameters" in text(same)
    assert "stage/replica" in text(same)
    split = [fin(0, 0, "a"), fin(0, 1, "c"), fin(1, 0, "b"), fin(1, 1, "b")]
    assert "the replicas of stage(s) 0 hold different parameters" in text(split)
    bare = [{"cluster": "east", "host": "e1", "rank": 0}]
    assert "parameters" not in text(bare).split("sha256", 1)[1]


@pytest.mark.slow
def test_pipelined_job_on_this_machine(cli: CLI, tmp_path: Path) -> None:
    """Two local clusters, one pipelined world: the placement is followed and the loss falls."""
    spec = yaml.safe_load(spec_text("parallelism: {pipeline_stages: 2}\nplacement: place.json",
                                    slots=1).replace("hosts:", "transport: local, hosts:"))
    spec.update(workdir=str(REPO / "examples" / "gpt"), deepspeed="ds_config.json",
                env={"OMP_NUM_THREADS": "1"},
                run="python -u train_pipe.py --steps 12 --eval-every 6 --log-every 3")
    (tmp_path / "place.json").write_text(json.dumps({"stages": [["west/w1/0"], ["east/e1/0"]]}))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    proc = cli("launch", str(tmp_path / "job.yaml"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = cli.job_ids()
    metrics = list((cli.home / "jobs" / job_id).rglob("*.jsonl"))
    recs = [json.loads(x) for p in metrics for x in p.read_text().splitlines() if x]
    landed = {r["cluster"]: (r["rank"], r["stage"]) for r in recs if r.get("placement")}
    assert landed == {"west": (0, 0), "east": (1, 1)}
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 2 and all(r["eval_loss"] < r["first_loss"] for r in finals)
