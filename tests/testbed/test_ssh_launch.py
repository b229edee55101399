"""nebula over real SSH: hosts are sshd servers in network namespaces (the test bed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from helpers.interrupts import launch_and_interrupt, mentions
from helpers.jobs import CLI, REMOTE_JOBS, REPO, job_processes, wait_for
from helpers.quickstart import SHORT_CONTEXT, TINY_GPT, relay_logs
from helpers.ssh_jobs import records, ssh_spec

from testbed import TestBed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


def test_quickstart_model_over_ssh(ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    """East's relay runs on e2 (its rank 0 on e1 reaches it with mutual TLS), west's on w1
    beside its rank 0 (the relay's Unix socket, no TLS)."""
    quick = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    relay = quick["relay"]
    relay["sync"]["inner_steps"] = 10
    relay["shaping"] = {"rate_mbit": None, "delay_ms": 25}  # the bed's tc shapes the rate
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1", "e2"], "west": ["w1", "w2"]},
                    run=f"python -u train.py --steps 30 --eval-every 10 --log-every 5 {TINY_GPT}",
                    relay=relay, workdir=REPO / "examples" / "gpt", deepspeed="ds_config.json")
    text = yaml.safe_load(spec.read_text())
    text["clusters"][0]["gateway"] = "e2"
    spec.write_text(yaml.safe_dump(text))
    proc = ssh_cli("launch", str(spec), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = ssh_cli.job_ids()
    out = proc.stdout
    assert "all 4 workers hold identical parameters" in out
    assert "uploaded" in proc.stderr
    finals = [r for r in records(job_id) if r.get("final")]
    assert {(r["cluster"], r["host"]) for r in finals} == {
        ("east", "e1"), ("east", "e2"), ("west", "w1"), ("west", "w2")}
    assert len({r["param_sha256"] for r in finals}) == 1
    for path in (REMOTE_JOBS / job_id).glob("*/*/worker/agent.json"):  # found, not given
        env = json.loads(path.read_text())["processes"][0]["env"]
        assert env["GLOO_SOCKET_IFNAME"] == bed_clean.interface(env["NEBULA_HOST"]), path
    logs = relay_logs(REMOTE_JOBS / job_id)
    assert "connected through mutual TLS" in logs["east"], logs["east"][-2000:]
    assert "connected through the local socket" not in logs["east"]
    assert "connected through the local socket" in logs["west"], logs["west"][-2000:]
    assert "connected through mutual TLS" not in logs["west"]
    rounds = [r for r in records(job_id) if r.get("outer_round") is not None]
    assert rounds and all(r["clusters_present"] == 2 for r in rounds)
    assert all(r["wan_bytes_sent"] > 100_000 for r in rounds)
    first = next(r["loss"] for r in records(job_id) if "loss" in r)
    assert finals[0]["eval_loss"] < first - 0.3
    st = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED"
    assert job_processes(job_id) == []
    assert "already ended" in ssh_cli("stop", job_id, check=True).stdout


def test_launch_status_stop_over_ssh_through_a_bastion(ssh_cli: CLI, bed_clean: TestBed,
                                                       tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1-jump"], "west": ["w1"]},
                    run='echo "on $(ip -4 -o addr show eth0 | awk \'{print $4}\')"; sleep 300')
    data = yaml.safe_load(spec.read_text())
    data["setup"] = 'echo "prepared $NEBULA_HOST"'
    spec.write_text(yaml.safe_dump(data))
    launched = ssh_cli("launch", str(spec), "--detach", check=True)
    assert "east/e1-jump setup | prepared e1-jump" in launched.stderr  # streamed over SSH
    job_id = launched.stdout.strip()
    logs = ""
    for _ in range(60):
        logs = ssh_cli("logs", job_id).stdout
        if logs.count("on 198.18.") == 2:
            break
        time.sleep(0.5)
    assert f"east/e1-jump/0 | on {bed_clean.hosts['e1'].address}/" in logs
    assert f"west/w1/0 | on {bed_clean.hosts['w1'].address}/" in logs
    st = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert {h["state"] for h in st["hosts"]} == {"RUNNING"}
    stopped = ssh_cli("stop", job_id, "--grace", "2", check=True)
    assert stopped.stdout.count("stopped ") >= 2
    assert job_processes(job_id) == []
    assert json.loads(ssh_cli("status", job_id, "--json").stdout)["state"] == "STOPPED"


def test_host_keys_unknown_refused_accept_new_records_changed_refused(
        ssh_cli: CLI, bed_clean: TestBed, tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1"]}, run="true")
    known = tmp_path / "known_hosts"
    known.write_text("")
    ssh_cli.env["NEBULA_KNOWN_HOSTS"] = str(known)
    refused = ssh_cli("validate", str(spec), "--hosts")
    assert refused.returncode == 1
    assert "SHA256:" in refused.stderr and "e1" in refused.stderr
    accepted = ssh_cli("validate", str(spec), "--hosts", "--accept-new-host-keys")
    assert accepted.returncode == 0, accepted.stderr
    assert "all 1 hosts ready" in accepted.stdout
    assert bed_clean.hosts["e1"].address in known.read_text()
    # the recorded key replaced by another host's key: a changed key, always refused
    w1_key = next(line for line in bed_clean.known_hosts.read_text().splitlines()
                  if line.startswith(bed_clean.hosts["w1"].address + " "))
    known.write_text(w1_key.replace(bed_clean.hosts["w1"].address,
                                    bed_clean.hosts["e1"].address) + "\n")
    for extra in ([], ["--accept-new-host-keys"]):
        changed = ssh_cli("validate", str(spec), "--hosts", *extra)
        assert changed.returncode == 1 and "CHANGED" in changed.stderr.upper()


def test_validate_hosts_reports_versions(ssh_cli: CLI, bed_clean: TestBed,
                                         tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1", "e2"], "west": ["w1-jump"]},
                    run="true")
    proc = ssh_cli("validate", str(spec), "--hosts", check=True)
    assert version("torch") in proc.stdout and version("deepspeed") in proc.stdout
    assert "all 3 hosts ready" in proc.stdout
    rows = {}  # host -> the row's cells (rich draws │ between them)
    for line in proc.stdout.splitlines():
        cells = [c for c in line.replace("│", " ").split() if c]
        if cells[:1] in (["east"], ["west"]):
            rows[cells[1]] = cells
    assert rows["e1"][-1] == bed_clean.interface("e1") and rows["e2"][-1] == bed_clean.interface(
        "e2")  # found, not given: the hosts' names resolve to loopback
    assert rows["w1-jump"][-1] == "-"  # one host: loopback, nothing to choose


def test_stopped_sshd_fails_the_launch_cleanly(ssh_cli: CLI, bed_clean: TestBed,
                                               tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1", "e2"], "west": ["w1"]},
                    run="sleep 300")
    bed_clean.stop_sshd("e2")
    try:
        proc = ssh_cli("launch", str(spec), "--detach")
    finally:
        bed_clean.start_sshd("e2")
    assert proc.returncode == 1 and "e2" in proc.stderr and "Traceback" not in proc.stderr
    (job_id,) = ssh_cli.job_ids()
    st = json.loads(ssh_cli("status", job_id, "--json").stdout)
    assert st["state"] == "FAILED" and "e2" in st["reason"]
    assert job_processes(job_id) == []


def test_unreachable_host_fails_the_launch_cleanly(ssh_cli: CLI, bed_clean: TestBed,
                                                   tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1"], "west": ["w1", "w2"]},
                    run="sleep 300")
    bed_clean.cut("w2")
    try:
        proc = ssh_cli("launch", str(spec), "--detach", timeout=180)
    finally:
        bed_clean.restore("w2")
    assert proc.returncode == 1 and "w2" in proc.stderr
    (job_id,) = ssh_cli.job_ids()
    assert json.loads(ssh_cli("status", job_id, "--json").stdout)["state"] == "FAILED"
    assert job_processes(job_id) == []


def test_host_cut_off_during_provisioning_fails_cleanly(ssh_cli: CLI, bed_clean: TestBed,
                                                        tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1"], "west": ["w1", "w2"]},
                    run="sleep 300")
    data = yaml.safe_load(spec.read_text())
    data["setup"] = 'if [ "$NEBULA_HOST" = w2 ]; then sleep 60; fi'
    spec.write_text(yaml.safe_dump(data))
    launch = subprocess.Popen(
        [sys.executable, "-m", "nebula_cli", "launch", str(spec), "--detach"],
        env=ssh_cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "w2: running setup" not in "".join(
                p.read_text() for p in ssh_cli.home.glob("jobs/*/launch.log")):
            time.sleep(0.2)
        bed_clean.cut("w2")
        out, err = launch.communicate(timeout=120)
    finally:
        bed_clean.restore("w2")
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 1 and "w2" in err and "connection lost" in err, err
    (job_id,) = ssh_cli.job_ids()
    assert json.loads(ssh_cli("status", job_id, "--json").stdout)["state"] == "FAILED"
    # the cut host's setup could not be ended while it was unreachable; now it is back,
    # `stop` ends what is left of the job there
    ssh_cli("stop", job_id, "--grace", "1", check=True)
    assert job_processes(job_id) == []
    bed_clean.end_stale_sessions("w2")  # sshd's side of the connections the cut killed


def test_pipeline_follows_the_placement_over_ssh(ssh_cli: CLI, bed_clean: TestBed,
                                                 tmp_path: Path) -> None:
    """2 stages x 2 replicas over 2 clusters in one DeepSpeed world: `nebula plan placement`
    picks the devices, the launch puts every stage of every replica where the plan says."""
    clusters = {"east": ["e1", "e2"], "west": ["w1", "w2"]}
    run = f"python -u train_pipe.py --steps 16 --eval-every 8 --log-every 4 {SHORT_CONTEXT}"
    gpt = REPO / "examples" / "gpt"
    pipe = {"parallelism": {"pipeline_stages": 2, "cleartext_wan": True}}
    bare = ssh_spec(tmp_path, bed_clean, clusters=clusters, run=run, name="pipe",
                    workdir=gpt, deepspeed="ds_config.json", extra=pipe)
    # a fast network inside each cluster, a slow one across; activations far heavier than
    # gradients: the cheapest plan keeps each replica's stage-to-stage link inside a cluster
    netbench = tmp_path / "netbench.json"
    netbench.write_text(json.dumps({
        "clusters": {c: {"intra": {"rtt_ms": 0.2, "throughput_mbit": 10000}} for c in clusters},
        "pairs": [{"a": "east", "b": "west", "rtt_ms": 50.0, "throughput_mbit": 20}]}))
    plan = ssh_cli("plan", "placement", "--spec", str(bare), "--netbench", str(netbench),
                   "--stages", "2", "--dp", "2", "--activation-gb", "1", "--gradient-gb",
                   "0.001", "--budget", "200", "--no-baselines", "--json", check=True)
    stages = json.loads(plan.stdout)["stages"]
    default = [["east/e1/0", "east/e2/0"], ["west/w1/0", "west/w2/0"]]
    assert stages != default  # the launch must follow the plan, not the host order
    for j in range(2):  # replica r's two stages share a cluster
        assert stages[0][j].split("/")[0] == stages[1][j].split("/")[0], stages
    placement = tmp_path / "placement.json"
    placement.write_text(plan.stdout)
    spec = ssh_spec(tmp_path, bed_clean, clusters=clusters, run=run, name="pipe",
                    workdir=gpt, deepspeed="ds_config.json",
                    extra={**pipe, "placement": str(placement)})

    proc = ssh_cli("launch", str(spec), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each stage's replicas hold identical parameters" in proc.stdout
    assert "cross the WAN unencrypted" in proc.stderr + proc.stdout  # said at launch
    (job_id,) = ssh_cli.job_ids()
    recs = records(job_id)
    landed = {r["device"]: r for r in recs if r.get("placement")}
    assert sorted(landed) == sorted(d for row in stages for d in row)
    for device, r in landed.items():
        stage, replica = next((j, row.index(device)) for j, row in enumerate(stages)
                              if device in row)
        cluster, host, _ = device.split("/")
        assert (r["cluster"], r["host"]) == (cluster, host)  # logged by the process on it
        assert (r["stage"], r["replica"]) == (stage, replica)
        assert r["rank"] == stage * 2 + replica  # DeepSpeed's pipe/data topology
        assert (r["stages"], r["replicas"]) == (2, 2)
    finals = [r for r in recs if r.get("final")]
    assert len(finals) == 4
    for r in finals:
        assert r["eval_loss"] < r["first_loss"] - 0.5, r  # the loss falls
    for j in range(2):
        assert len({r["param_sha256"] for r in finals if r["stage"] == j}) == 1
    assert len({r["param_sha256"] for r in finals}) == 2  # the two stages differ


def test_ctrl_c_during_setup_over_ssh_cancels_the_launch(ssh_cli: CLI, bed_clean: TestBed,
                                                         tmp_path: Path) -> None:
    spec = ssh_spec(tmp_path, bed_clean, clusters={"east": ["e1"], "west": ["w1"]},
                    run="sleep 300", relay={},
                    extra={"setup": "echo setting up; sleep 120"})
    job_id, code, seconds = launch_and_interrupt(ssh_cli, spec, "setup | setting up")
    assert code == 130 and seconds < 10, (code, seconds)
    status = json.loads(ssh_cli("status", job_id, "--json", check=True).stdout)
    assert status["state"] == "CANCELLED"
    assert wait_for(lambda: not mentions(job_id), timeout=5)  # the remote setups too
