"""launch -> status -> logs -> stop through the real CLI, local transport, real agents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers.jobs import CLI, REPO, job_processes, kill_job_processes, wait_for, write_spec

HELLO = """
name: hello
workdir: .
run: >-
  echo "I am $NEBULA_CLUSTER/$NEBULA_HOST rank $RANK of $WORLD_SIZE
  node $NEBULA_NODE_RANK/$NEBULA_NUM_NODES"; i=0;
  while [ $i -lt {ticks} ]; do i=$((i+1)); echo "tick $i"; sleep {every}; done
env: {{GREETING: hi, API_TOKEN: s3cret}}
clusters:
  - name: east
    transport: local
    hosts: [{{host: e1}}, {{host: e2}}]
  - name: west
    transport: local
    hosts: [{{host: w1}}, {{host: w2, slots: 2}}]
"""


def spec(tmp_path: Path, ticks: int = 600, every: float = 0.5) -> Path:
    return write_spec(tmp_path, HELLO.format(ticks=ticks, every=every))


def status_json(cli: CLI, job_id: str) -> dict[str, Any]:
    return json.loads(cli("status", job_id, "--json", check=True).stdout)


def test_launch_status_logs_stop(cli: CLI, tmp_path: Path) -> None:
    launched = cli("launch", str(spec(tmp_path)), "--detach", check=True)
    job_id = launched.stdout.strip()
    assert job_id.startswith("hello-") and cli.job_ids() == [job_id]

    st = wait_for(lambda: (s := status_json(cli, job_id))["state"] == "RUNNING"
                  and all(h["state"] == "RUNNING" for h in s["hosts"]) and s)
    assert {(h["cluster"], h["host"]) for h in st["hosts"]} == {
        ("east", "e1"), ("east", "e2"), ("west", "w1"), ("west", "w2")}
    assert all(h["pid"] and h["exit_code"] is None for h in st["hosts"])

    listing = json.loads(cli("status", "--json", check=True).stdout)
    assert [j["id"] for j in listing] == [job_id] and listing[0]["hosts"] == 4

    wait_for(lambda: "tick 2" in cli("logs", job_id, "--host", "w2").stdout)
    logs = cli("logs", job_id, check=True).stdout
    assert "east/e1/0 | I am east/e1 rank 0 of 2 node 0/2" in logs
    assert "west/w2/2 | I am west/w2 rank 2 of 3 node 1/2" in logs
    only = cli("logs", job_id, "--cluster", "west", "--rank", "1", "--tail", "1").stdout
    assert only.count("\n") == 1 and only.startswith("west/w2/1 | ")

    pids = job_processes(job_id)
    assert len(pids) >= 5  # 5 ranks (plus their agents)
    stopped = cli("stop", job_id, "--grace", "2", check=True)
    assert stopped.stdout.count("stopped ") >= 4 and "stopped" in stopped.stdout.splitlines()[-1]
    assert job_processes(job_id) == []
    after = status_json(cli, job_id)
    assert after["state"] == "STOPPED" and {h["state"] for h in after["hosts"]} == {"STOPPED"}

    again = cli("stop", job_id)
    assert again.returncode == 0 and "already ended" in again.stdout


def test_foreground_launch_streams_prefixed_logs_and_succeeds(cli: CLI, tmp_path: Path) -> None:
    proc = cli("launch", str(spec(tmp_path, ticks=2, every=0.2)), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "east/e2/1 | I am east/e2 rank 1 of 2" in proc.stdout
    assert "west/w2/2 | tick 2" in proc.stdout
    assert "SUCCEEDED" in proc.stdout
    assert "s3cret" not in proc.stdout + proc.stderr


def test_worker_killed_while_detached_shows_failed(cli: CLI, tmp_path: Path) -> None:
    job_id = cli("launch", str(spec(tmp_path)), "--detach", check=True).stdout.strip()
    st = wait_for(lambda: (s := status_json(cli, job_id))["hosts"]
                  and all(h["state"] == "RUNNING" for h in s["hosts"]) and s)
    victim = next(h for h in st["hosts"] if h["host"] == "e1")
    os.kill(victim["pid"], signal.SIGKILL)
    after = wait_for(lambda: (s := status_json(cli, job_id)) and any(
        h["host"] == "e1" and h["state"] == "FAILED" for h in s["hosts"]) and s)
    e1 = next(h for h in after["hosts"] if h["host"] == "e1")
    assert e1["exit_code"] == -9 and "killed by SIGKILL" in e1["detail"]["reason"]
    text = cli("status", job_id).stdout
    assert "FAILED" in text and "-9" in text

    # every other process dies too, unwatched: the job ends FAILED, never stuck RUNNING
    for h in after["hosts"]:
        if h["state"] == "RUNNING":
            for pid in h["detail"].get("pids") or [h["pid"]]:
                os.kill(pid, signal.SIGKILL)
    final = wait_for(lambda: (s := status_json(cli, job_id))["state"] != "RUNNING" and s)
    assert final["state"] == "FAILED" and "e1" in final["reason"]
    plain = cli("status").stdout  # the jobs by name and short id, which commands take
    assert job_id.rsplit("-", 1)[1] in plain and "FAILED" in plain
    assert job_id in cli("status", job_id.rsplit("-", 1)[1], check=True).stdout


def test_dead_agent_and_workers_are_not_stuck_running(cli: CLI, tmp_path: Path) -> None:
    job_id = cli("launch", str(spec(tmp_path)), "--detach", check=True).stdout.strip()
    wait_for(lambda: all(h["state"] == "RUNNING" for h in status_json(cli, job_id)["hosts"]))
    assert kill_job_processes(job_id)  # agents and workers, all at once
    final = wait_for(lambda: (s := status_json(cli, job_id))["state"] != "RUNNING" and s)
    assert final["state"] == "FAILED"
    assert {h["state"] for h in final["hosts"]} <= {"FAILED", "LOST"}


def test_exit_codes(cli: CLI, tmp_path: Path) -> None:
    bad = write_spec(tmp_path, "name: x\nrun: true\nclusters: []\n", "bad.yaml")
    assert cli("validate", str(bad)).returncode == 2
    assert cli("launch", str(bad)).returncode == 2
    assert cli("validate", str(tmp_path / "missing.yaml")).returncode == 2
    assert cli("status", "no-such-job").returncode == 2
    assert cli("launch").returncode == 2  # missing argument: usage
    assert cli("validate", str(spec(tmp_path))).returncode == 0
    failing = write_spec(tmp_path, HELLO.format(ticks=1, every=0.1).replace(
        "run: >-\n", "run: >-\n  exit 3;\n"), "failing.yaml")
    proc = cli("launch", str(failing), timeout=120)
    assert proc.returncode == 1 and "FAILED" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_setup_output_streams_and_a_failed_setup_fails_the_launch(cli: CLI,
                                                                  tmp_path: Path) -> None:
    body = HELLO.format(ticks=600, every=0.5)
    good = write_spec(tmp_path, body + 'setup: echo "preparing $NEBULA_HOST"; echo done\n',
                      "good.yaml")
    proc = cli("launch", str(good), "--detach", check=True)
    assert "east/e1 setup | preparing e1" in proc.stderr
    assert "west/w2 setup | done" in proc.stderr
    bad = write_spec(tmp_path, body + 'setup: echo "no disk on $NEBULA_HOST" >&2; exit 4\n',
                     "bad.yaml")
    proc = cli("launch", str(bad), "--detach")
    assert proc.returncode == 1 and "setup failed" in proc.stderr
    assert "no disk on" in proc.stderr and "Traceback" not in proc.stderr
    failed = next(j for j in cli.job_ids() if json.loads(
        cli("status", j, "--json").stdout)["state"] == "FAILED")
    assert job_processes(failed) == []


METRICS = """
name: metered
workdir: .
run: >-
  python -c "from nebula_cli.runtime import log;
  [log(step=i, loss=8.0 / i, tokens_per_s=100.0 + i) for i in range(1, 3001)];
  log(step=3000, final=True, eval_loss=0.25, last_loss=8.0 / 3000)"
clusters:
  - name: east
    transport: local
    hosts: [{host: e1}]
"""


def test_status_shows_the_agents_metric_summaries(cli: CLI, tmp_path: Path) -> None:
    job_id = cli("launch", str(write_spec(tmp_path, METRICS)), "--detach", check=True
                 ).stdout.strip()
    st = wait_for(lambda: (s := status_json(cli, job_id))["state"] == "SUCCEEDED" and s, 60)
    east = st["metrics"]["east"]
    assert (east["step"], east["tokens_per_s"], east["eval_loss"]) == (3000, 3100.0, 0.25)
    assert east["loss"] == 8.0 / 3000
    kept = st["hosts"][0]["detail"]["metrics_summary"]
    assert kept["complete"] and kept["ranks"]["0"]["final"]["last_loss"] == 8.0 / 3000
    assert "3000" in cli("status", job_id, check=True).stdout
    assert st["final_parameters"] is None  # its final record has no checksum


DIVERGED = """
name: diverged
workdir: .
run: >-
  python -c "import os; from nebula_cli.runtime import log;
  log(step=5, final=True, param_sha256=os.environ['NEBULA_CLUSTER'] * 8)"
clusters:
  - {name: east, transport: local, hosts: [{host: e1}]}
  - {name: west, transport: local, hosts: [{host: w1}]}
"""


def test_status_says_when_the_workers_ended_with_different_parameters(
        cli: CLI, tmp_path: Path) -> None:
    """Two clusters ending with their own parameters (seen in the soak after a partition at
    the end) was a red line in the live view only; `status` says it too, text and JSON."""
    job_id = cli("launch", str(write_spec(tmp_path, DIVERGED)), "--detach", check=True
                 ).stdout.strip()
    st = wait_for(lambda: (s := status_json(cli, job_id))["state"] == "SUCCEEDED" and s, 60)
    assert st["final_parameters"] == {"identical": False, "workers": 2, "sets": 2,
                                      "without_checksum": 0, "stages_differing": None}
    shown = cli("status", job_id, check=True).stdout
    assert "workers hold 2 different parameter sets" in shown


def test_logs_follow_until_the_job_ends(cli: CLI, tmp_path: Path) -> None:
    job_id = cli("launch", str(spec(tmp_path, ticks=4, every=0.5)), "--detach", check=True
                 ).stdout.strip()
    followed = cli("logs", job_id, "-f", "--tail", "1", "--host", "w2", timeout=60)
    assert followed.returncode == 0, followed.stderr
    assert "west/w2/2 | tick 4" in followed.stdout and "east/" not in followed.stdout
    assert "warning" not in followed.stderr


def test_stop_without_grace_uses_the_specs_grace(cli: CLI, tmp_path: Path) -> None:
    """`grace: 0.5` in the spec: a worker that needs 3 s to wind down is killed after 0.5 s
    (the CLI's own default used to override the spec's)."""
    marker = tmp_path / "wound-down"
    body = f"""
    name: graceful
    workdir: .
    grace: 0.5
    run: >-
      trap 'sleep 3; echo done > {marker}; exit 0' TERM; echo up;
      while true; do sleep 0.2; done
    clusters:
      - {{name: east, transport: local, hosts: [e1]}}
    """
    job_id = cli("launch", str(write_spec(tmp_path, body)), "--detach", check=True
                 ).stdout.strip()
    wait_for(lambda: "up" in cli("logs", job_id).stdout, timeout=30)
    stopped = cli("stop", job_id, check=True)
    assert "stopped east/e1 worker" in stopped.stdout
    time.sleep(3.5)
    assert not marker.exists()  # SIGKILLed after the spec's 0.5 s, not 10 s
    assert not job_processes(job_id)


def test_stop_ends_the_workers_before_their_relays(cli: CLI, tmp_path: Path) -> None:
    body = """
    name: ordered
    workdir: .
    run: sleep 300
    relay: {}
    clusters:
      - {name: east, transport: local, hosts: [e1]}
      - {name: west, transport: local, hosts: [w1]}
    """
    job_id = cli("launch", str(write_spec(tmp_path, body)), "--detach", check=True
                 ).stdout.strip()
    wait_for(lambda: all(h["state"] == "RUNNING" for h in status_json(cli, job_id)["hosts"]),
             timeout=60)
    cli("stop", job_id, check=True)
    ended = {(h["role"], h["cluster"]): json.loads(
        (Path(h["agent_dir"]) / "status.json").read_text())["ended"]
        for h in status_json(cli, job_id)["hosts"]}
    workers = [t for (role, _), t in ended.items() if role == "worker"]
    relays = [t for (role, _), t in ended.items() if role == "relay"]
    assert len(workers) == len(relays) == 2 and max(workers) <= min(relays)


HUNG = """
name: hung
workdir: .
run: >-
  if [ "$NEBULA_HOST" = e2 ]; then echo "e2 gives up"; exit 3; fi;
  echo "$NEBULA_HOST waits for its peer"; sleep 600
clusters:
  - name: east
    transport: local
    hosts: [{host: e1}, {host: e2}]
  - name: west
    transport: local
    hosts: [{host: w1}]
"""


def test_a_worker_that_fails_for_good_ends_the_job_within_seconds(
        cli: CLI, tmp_path: Path) -> None:
    """e2's rank fails with no restarts left while e1's waits for it forever (as in a
    collective): the next look at the job ends every process and the job is FAILED with
    e2's exit, not RUNNING for as long as e1 would wait."""
    job_id = cli("launch", str(write_spec(tmp_path, HUNG)), "--detach", check=True
                 ).stdout.strip()
    t0 = time.monotonic()
    st = wait_for(lambda: (s := status_json(cli, job_id))["state"] == "FAILED" and s, 60)
    assert time.monotonic() - t0 < 30
    assert "east/e2 worker" in st["reason"]
    assert "exit 3: e2 gives up" in st["reason"]  # with its last output line
    states = {h["host"]: (h["state"], h["detail"].get("reason")) for h in st["hosts"]}
    assert states["e2"][0] == "FAILED"
    assert states["e1"][0] == "STOPPED" and "stopped: east/e2 worker" in states["e1"][1]
    assert states["w1"][0] == "STOPPED"
    assert job_processes(job_id) == []
    logs = cli("logs", job_id, check=True).stdout
    assert "e1 waits for its peer" in logs and "e2 gives up" in logs


def test_killing_the_launching_terminal_changes_nothing_for_the_job(
        cli: CLI, tmp_path: Path) -> None:
    """`nebula launch` in the foreground is SIGKILLed (a closed laptop lid, a lost terminal):
    the job runs on, and status, logs and stop work from another terminal."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "nebula_cli", "launch", str(spec(tmp_path, every=0.2))],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        job_id = wait_for(lambda: cli.job_ids() and cli.job_ids()[0], timeout=60)
        wait_for(lambda: "tick 3" in cli("logs", job_id, "--host", "w2").stdout, timeout=60)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
    ticks = cli("logs", job_id, "--host", "e1", check=True).stdout.count("tick ")
    wait_for(lambda: cli("logs", job_id, "--host", "e1").stdout.count("tick ") > ticks + 2)
    assert status_json(cli, job_id)["state"] == "RUNNING"
    cli("stop", job_id, "--grace", "1", check=True)
    assert status_json(cli, job_id)["state"] == "STOPPED" and job_processes(job_id) == []


def test_a_host_missing_deepspeed_is_named_before_anything_starts(cli: CLI,
                                                                  tmp_path: Path) -> None:
    """launchers/bootstrap.sh, after setup: an interpreter that finds nebula but not torch."""
    bare = tmp_path / "bare-python"  # no site-packages: torch and deepspeed are not found
    bare.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO}" '
                    f'exec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    body = HELLO.format(ticks=600, every=0.5).replace(
        "    transport: local\n", f"    transport: local\n    python: {bare}\n", 1)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    proc = cli("launch", str(write_spec(tmp_path, body + "deepspeed: ds.json\n")), "--detach")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"east/e1: torch is not installed for '{bare}'" in proc.stderr
    assert "pip install torch" in proc.stderr
    (job_id,) = cli.job_ids()
    assert status_json(cli, job_id)["state"] == "FAILED"
    assert job_processes(job_id) == []
