"""The quickstart end to end: two clusters of DeepSpeed workers joined by the relay, through the
real CLI, with a short schedule. And the same with three and four clusters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, job_processes, wait_for
from helpers.quickstart import SHORT_CONTEXT, check_finished_job, metric_records, short_spec

pytestmark = pytest.mark.slow


def test_quickstart_two_clusters_overlapped(cli: CLI, tmp_path: Path) -> None:
    """Overlapped sync, each average applied at the step the relays agreed from the last
    rounds' times (1 before they have), the same on every cluster: the clusters still end
    identical."""
    spec = short_spec(tmp_path, clusters={"east": ["e1", "e2"], "west": ["w1", "w2"]},
                      steps=50, inner=10, overlap=True)
    proc = cli("launch", str(spec), timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    (job_id,) = cli.job_ids()
    assert "east/e1/relay |" in out and "west/w2/1 |" in out
    assert "all 4 workers hold identical parameters" in out
    assert "SUCCEEDED" in out and "eval loss" in out
    check_finished_job(cli, job_id, workers=4, rounds=5)
    merged = {(r["cluster"], r["outer_round"]): r["merged_after_steps"]
              for r in metric_records(cli.home, job_id)
              if r.get("applied") and "merged_after_steps" in r}
    assert sorted(r for c, r in merged if c == "east") == [0, 1, 2, 3, 4]  # 4: the flush
    assert merged["east", 0] == merged["west", 0] == 1  # nothing agreed yet
    agreed = {r["round"]: r["next_merge"] for path in
              (cli.home / "jobs" / job_id).glob("*/*/relay/metrics/*.jsonl")
              for r in map(json.loads, path.read_text().splitlines()) if r.get("next_merge")}
    assert 1 in agreed and 2 in agreed  # from the second round's READYs on
    for r in (2, 3):  # the step round r-1 agreed, on both clusters
        assert merged["east", r] == merged["west", r] == min(agreed[r - 1], 10)


@pytest.mark.parametrize("n", [3, 4])
def test_three_and_four_clusters_end_identical(cli: CLI, tmp_path: Path, n: int) -> None:
    """n clusters of one worker each (int8: shard mode, each relay averaging the chunks it
    owns): SUCCEEDED, every worker with the same parameters, every round with all clusters."""
    clusters = {c: [f"{c}1"] for c in "abcd"[:n]}
    spec = short_spec(tmp_path, clusters=clusters, steps=20, inner=10, name=f"n{n}")
    job_id = cli("launch", str(spec), "--detach", check=True).stdout.strip()
    follow = cli("logs", job_id, "-f", timeout=900)
    assert follow.returncode == 0, follow.stderr
    assert "gpt: final" in follow.stdout, (
        follow.stderr + cli("status", job_id).stdout + follow.stdout[-4000:])
    check_finished_job(cli, job_id, workers=n, rounds=2)
    synced = [r for r in metric_records(cli.home, job_id) if r.get("outer_round") is not None
              and "round_s" in r]
    assert synced and all(r["clusters_present"] == n for r in synced)
    relay_rounds = [json.loads(line) for path in
                    (cli.home / "jobs" / job_id).glob("*/*/relay/metrics/*.jsonl")
                    for line in path.read_text().splitlines() if line]
    assert len(relay_rounds) == 2 * n and {r["mode"] for r in relay_rounds} == {"shard"}


def rounds_of(cli: CLI, job_id: str, cluster: str) -> list[dict[str, Any]]:
    return [r for r in metric_records(cli.home, job_id)
            if r.get("cluster") == cluster and r.get("outer_round") is not None]


def _is_rank_of(pid: int, agent_child: int) -> bool:
    """Whether ``pid`` is ``agent_child`` or one of its descendants (a worker's ranks)."""
    while pid > 1:
        if pid == agent_child:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def test_relay_killed_mid_run_is_left_out_then_catches_up(cli: CLI, tmp_path: Path) -> None:
    spec_path = short_spec(tmp_path, clusters={"east": ["e1"], "west": ["w1"]},
                           steps=120, inner=5, name="relaykill", model=SHORT_CONTEXT)
    spec = yaml.safe_load(spec_path.read_text())
    spec["relay"].update(timeout=4, heartbeat=1, dead_after=3)
    spec_path.write_text(yaml.safe_dump(spec))
    job_id = cli("launch", str(spec_path), "--detach", check=True).stdout.strip()
    try:
        wait_for(lambda: len(rounds_of(cli, job_id, "west")) >= 2, timeout=600)
        st = json.loads(cli("status", job_id, "--json", check=True).stdout)
        (relay,) = [h for h in st["hosts"] if h["role"] == "relay" and h["cluster"] == "east"]
        os.kill(relay["pid"], signal.SIGSTOP)  # east's relay hangs: west must go on alone
        alone = wait_for(lambda: [r for r in rounds_of(cli, job_id, "west")
                                  if r["clusters_present"] == 1], timeout=120)
        assert alone
        # then dies; its agent restarts it. Meanwhile west's worker is held (SIGSTOP), so that
        # west cannot finish its rounds before east is back however loaded the machine is
        (worker,) = [h for h in st["hosts"] if h["role"] == "worker" and h["cluster"] == "west"]
        held = [p for p in job_processes(job_id) if _is_rank_of(p, worker["pid"])]
        assert held
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(relay["pid"], signal.SIGKILL)
            wait_for(lambda: any(h["role"] == "relay" and h["cluster"] == "east"
                                 and h["restarts"] >= 1 and h["state"] == "RUNNING"
                                 for h in json.loads(cli("status", job_id, "--json").stdout
                                                     or "{}").get("hosts", [])), timeout=120)
        finally:
            for pid in held:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    finally:
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(relay["pid"], signal.SIGKILL)
    assert cli("logs", job_id, "-f", timeout=600).returncode == 0
    st = json.loads(cli("status", job_id, "--json", check=True).stdout)
    assert st["state"] == "SUCCEEDED", st
    (relay,) = [h for h in st["hosts"] if h["role"] == "relay" and h["cluster"] == "east"]
    assert relay["restarts"] >= 1
    east, west = rounds_of(cli, job_id, "east"), rounds_of(cli, job_id, "west")
    # east missed a round or more (caught up from west's published state, or handed the
    # average of the clusters that were present), then trains in step with west again
    outage = [i for i, r in enumerate(east) if r.get("caught_up") or r["clusters_present"] < 2]
    assert outage, "east's relay outage left no trace in east's rounds"
    joint_east = {r["outer_round"] for r in east[outage[0] + 1:] if r["clusters_present"] == 2}
    joint_west = {r["outer_round"] for r in west if r["clusters_present"] == 2}
    assert len(joint_east) >= 5 and joint_east <= joint_west
    # east skipped round ids when it caught up, so the clusters' last rounds differ; they
    # still end with the same parameters (the state of the one that finished last)
    finals = [r for r in metric_records(cli.home, job_id) if r.get("final")]
    assert len(finals) == 2 and len({r["param_sha256"] for r in finals}) == 1, finals
    assert job_processes(job_id) == []
