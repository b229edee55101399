"""`nebula resume` through the real CLI (local transport, real agents and relays): a stopped
job continues under the same id with a new CA and certificates, `status` shows the attempt,
and what cannot be resumed is refused with the reason (exit 2), nothing started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, REPO, job_processes, wait_for, write_spec
from helpers.quickstart import SHORT_CONTEXT

# The first attempt marks the workdir and waits to be stopped; the second one sees the mark
# and ends at once (a stand-in for a worker that finds its checkpoint).
SPEC = """
name: again
workdir: .
run: >-
  if [ -e "done-$NEBULA_CLUSTER-$RANK" ]; then echo "resumed $NEBULA_CLUSTER/$RANK";
  else touch "done-$NEBULA_CLUSTER-$RANK"; echo "first $NEBULA_CLUSTER/$RANK"; sleep 600; fi
relay: {{port: {port}}}
clusters:
  - name: east
    transport: local
    hosts: [{{host: e1}}]
  - name: west
    transport: local
    hosts: [{{host: w1}}]
"""


def status_json(cli: CLI, job_id: str) -> dict[str, Any]:
    return json.loads(cli("status", job_id, "--json", check=True).stdout)


def test_a_stopped_job_resumes_under_its_id_with_renewed_certificates(
        cli: CLI, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, SPEC.format(port=29700))
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()
    wait_for(lambda: "first west/0" in cli("logs", job_id).stdout, timeout=60)
    running = cli("resume", job_id)
    assert running.returncode == 2 and "is RUNNING" in running.stderr, running
    assert status_json(cli, job_id)["attempt"] == 1

    pki = cli.home / "jobs" / job_id / "pki"
    ca_key, certs = (pki / "ca.key").read_bytes(), sorted(pki.rglob("*.pem"))
    before = {p: p.read_bytes() for p in certs}
    assert len(before) >= 5  # the CA's, two relays', two workers' certificates
    cli("stop", job_id, "--grace", "1", check=True)
    assert status_json(cli, job_id)["state"] == "STOPPED" and job_processes(job_id) == []

    proc = cli("resume", job_id, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attempt 2" in proc.stdout + proc.stderr
    st = status_json(cli, job_id)
    assert st["id"] == job_id and st["state"] == "SUCCEEDED" and st["attempt"] == 2
    assert st["reason"] is None and st["ended"] is not None
    logs = cli("logs", job_id, check=True).stdout
    assert "resumed east/0" in logs and "resumed west/0" in logs
    assert (pki / "ca.key").read_bytes() != ca_key  # a new CA (the old keys are refused) ...
    assert all(p.read_bytes() != data for p, data in before.items())  # ... new certificates
    assert job_processes(job_id) == []
    assert "attempt 2" in cli("status", job_id, check=True).stdout

    done = cli("resume", job_id)
    assert done.returncode == 2 and "SUCCEEDED" in done.stderr
    assert "nothing to resume" in done.stderr and job_processes(job_id) == []


def test_resume_of_an_unknown_job_is_refused(cli: CLI) -> None:
    proc = cli("resume", "no-such-job")
    assert proc.returncode == 2 and "no job 'no-such-job'" in proc.stderr


def test_resume_refuses_when_a_host_lost_its_checkpoints(cli: CLI, tmp_path: Path) -> None:
    """east's e1 holds a complete checkpoint, e2 none: the cluster could not agree on a step,
    so resume refuses naming e2 and where it looked (exit 2, nothing started, still STOPPED).
    With the checkpoint gone from e1 too, every cluster starts from the beginning (said)."""
    body = SPEC.format(port=29720).replace(
        "    hosts: [{host: e1}]", "    hosts: [{host: e1}, {host: e2}]") + \
        "checkpoint: {every: 10}\n"
    job_id = cli("launch", str(write_spec(tmp_path, body)), "--detach", check=True
                 ).stdout.strip()
    wait_for(lambda: "first west/0" in cli("logs", job_id).stdout, timeout=60)
    cli("stop", job_id, "--grace", "1", check=True)
    step = cli.home / "jobs" / job_id / "checkpoints" / "east" / "e1" / "step10"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    proc = cli("resume", job_id)
    assert proc.returncode == 2, proc
    assert "east/e2: no complete checkpoint in " in proc.stderr
    assert str(cli.home / "jobs" / job_id / "checkpoints" / "east" / "e2") in proc.stderr
    st = status_json(cli, job_id)
    assert st["state"] == "STOPPED" and st["attempt"] == 1 and job_processes(job_id) == []

    (step / "COMPLETE").unlink()
    proc = cli("resume", job_id, "--detach")
    assert proc.returncode == 0, proc
    assert "no checkpoint on east, west: every cluster starts from the beginning" in proc.stderr
    wait_for(lambda: status_json(cli, job_id)["state"] == "SUCCEEDED", timeout=120)
    assert job_processes(job_id) == []


@pytest.mark.slow
def test_a_stopped_training_job_resumes_from_its_checkpoints(cli: CLI, tmp_path: Path) -> None:
    """The small GPT (real DeepSpeed, relays) checkpoints every 10 steps; `stop` mid-run (each
    worker makes its final checkpoint), then `resume`: every cluster goes on from its newest
    checkpoint, the job ends SUCCEEDED at the full step count with identical parameters."""
    spec = yaml.safe_load((REPO / "templates" / "quickstart.yaml").read_text())
    spec.update(name="ckpt", workdir=str(REPO / "examples" / "gpt"),
                run=f"python -u train.py --steps 80 --eval-every 80 --log-every 5 {SHORT_CONTEXT}",
                checkpoint={"every": 10, "keep": 2})
    spec["clusters"] = [{"name": c, "transport": "local", "hosts": [{"host": h}]}
                        for c, h in (("east", "e1"), ("west", "w1"))]
    spec["relay"]["sync"]["inner_steps"] = 10
    spec["relay"].pop("shaping", None)
    path = tmp_path / "ckpt.yaml"
    path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(path), "--detach", check=True).stdout.strip()

    def records() -> list[dict[str, Any]]:
        out = []
        for p in (cli.home / "jobs" / job_id).glob("*/*/worker/metrics/*.jsonl"):
            out += [json.loads(x) for x in p.read_text().splitlines() if x]
        return out

    def saved(cluster: str) -> int:
        return max([r["checkpoint_step"] for r in records() if r.get("cluster") == cluster
                    and r.get("checkpoint_step") is not None], default=0)

    wait_for(lambda: saved("east") >= 20 and saved("west") >= 20, timeout=300, every=1.0)
    cli("stop", job_id, check=True, timeout=180)
    assert status_json(cli, job_id)["state"] == "STOPPED" and job_processes(job_id) == []
    stopped_at = {c: saved(c) for c in ("east", "west")}

    cli("resume", job_id, "--detach", check=True, timeout=300)
    st = wait_for(lambda: (s := status_json(cli, job_id))["state"] not in ("RUNNING", "PENDING")
                  and s, timeout=600, every=2.0)
    assert st["state"] == "SUCCEEDED" and st["attempt"] == 2, st
    resumed = {r["cluster"]: r["resumed_from_step"] for r in records()
               if r.get("resumed_from_step") is not None and not r.get("final")}
    assert resumed == stopped_at, (resumed, stopped_at)  # the newest checkpoint of each
    finals = [r for r in records() if r.get("final") and r["step"] == 80]
    assert len(finals) == 2 and len({r["param_sha256"] for r in finals}) == 1, finals
    # a cluster stopped mid-interval ran a last round alone, one stopped at a boundary did not:
    # they resume one round apart, and nobody waits the relay's timeout (120 s) for the other
    slow = [(r["cluster"], r["outer_round"], r["round_s"]) for r in records()
            if r.get("round_s", 0) > 60]
    assert slow == [], slow
    assert job_processes(job_id) == []
