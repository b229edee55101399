"""Relays that cannot be dialled: `relay_reach: outbound` makes a cluster's relay dial every
other cluster; a firewall (nftables in a test-bed host's namespace) proves it trains."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import CLI, REPO, job_processes, wait_for
from test_spec import one, write
from test_ssh_launch import records, ssh_spec
from testbed import TestBed

from nebula_cli.config.spec import load_spec

TWO = """\
name: reach
run: python train.py
clusters:
  - name: cloud
    relay_reach: outbound
    hosts: [a1]
  - name: lab
    hosts: [b1]
  - name: hpc
    hosts: [c1]
relay: {}
"""


def test_outbound_clusters_dial_the_others(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, TWO))
    assert spec.dial_order == ["lab", "hpc", "cloud"]  # each dials those before it
    assert load_spec(write(tmp_path, TWO.replace("relay_reach: outbound", "relay_reach: "
                                                 "inbound"))).dial_order == ["cloud", "lab",
                                                                             "hpc"]


def test_two_outbound_clusters_cannot_meet(tmp_path: Path) -> None:
    text = TWO.replace("  - name: hpc\n", "  - name: hpc\n    relay_reach: outbound\n")
    problem = one(tmp_path, text)
    assert problem.field == "clusters[2].relay_reach" and problem.line == 10
    assert "cloud and hpc both have relay_reach: outbound" in str(problem)


def test_unknown_reach_is_refused(tmp_path: Path) -> None:
    problem = one(tmp_path, TWO.replace("relay_reach: outbound", "relay_reach: tunnel"))
    assert problem.field == "clusters[0].relay_reach" and "outbound" in str(problem)


@contextlib.contextmanager
def inbound_blocked(bed: TestBed, host: str) -> Iterator[None]:
    """Drop every new inbound TCP connection on the host's interface but SSH (nftables)."""
    if shutil.which("nft") is None:
        pytest.skip("nft not found (apt-get install nftables)")
    rules = ("table inet nebula_fw {\n chain input {\n"
             "  type filter hook input priority 0; policy accept;\n"
             '  iifname "eth0" tcp dport != 22 ct state new drop\n }\n}\n')
    bed.run(host, ["nft", "-f", "-"], input=rules, check=True)
    try:
        yield
    finally:
        bed.run(host, ["nft", "delete", "table", "inet", "nebula_fw"])


@pytest.mark.testbed
@pytest.mark.slow
def test_cluster_behind_a_firewall_dials_out_and_trains(ssh_cli: CLI, bed_clean: TestBed,
                                                        tmp_path: Path) -> None:
    quick = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    relay = {**quick["relay"], "shaping": {"rate_mbit": None, "delay_ms": 10}}
    relay["sync"]["inner_steps"] = 10
    # west is listed first: without relay_reach, east would dial it and be dropped
    spec_path = ssh_spec(tmp_path, bed_clean, clusters={"west": ["w1"], "east": ["e1"]},
                         run="python -u train.py --steps 20 --eval-every 10 --log-every 5",
                         relay=relay, workdir=REPO / "examples" / "gpt",
                         deepspeed="ds_config.json")
    spec = yaml.safe_load(spec_path.read_text())
    spec["clusters"][0]["relay_reach"] = "outbound"
    spec_path.write_text(yaml.safe_dump(spec))
    with inbound_blocked(bed_clean, "w1"):
        w1 = bed_clean.hosts["w1"].address
        probe = bed_clean.run("e1", ["timeout", "3", "bash", "-c", f"</dev/tcp/{w1}/29400"])
        assert probe.returncode != 0  # the firewall holds: nothing reaches west's relay port
        proc = ssh_cli("launch", str(spec_path), timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = ssh_cli.job_ids()
    assert "all 2 workers hold identical parameters" in proc.stdout
    rounds = [r for r in records(job_id) if r.get("outer_round") is not None]
    assert rounds and all(r["clusters_present"] == 2 for r in rounds)
    st = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED"
    wait_for(lambda: job_processes(job_id) == [], timeout=30)


def test_validate_says_which_relay_dials_which(tmp_path: Path, cli: CLI) -> None:
    out = cli("validate", str(write(tmp_path, TWO)), check=True).stdout
    assert "relays: hpc dials lab, cloud dials lab, cloud dials hpc" in out
    # how they sync, with the defaults that follow the codec resolved
    topk = TWO.replace("relay: {}", "relay: {compression: topk, sync: {inner_steps: 10}}")
    out = " ".join(cli("validate", str(write(tmp_path, topk)), check=True).stdout.split())
    assert ("sync: diloco every 10 steps, outer lr 2.5 / no momentum, topk (density 0.0625, "
            "2 bits) with error feedback") in out
