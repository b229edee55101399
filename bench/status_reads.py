"""`nebula status JOB` on a long job: time and bytes read for metrics files of 1,000 records
against 1,000,000, side by side (issue 10, section 7: under 2 s, and no growth with the file).

Each side is a job recorded in its own temporary NEBULA_HOME, as `launch` would leave it: one
cluster with a worker agent and a relay agent on this machine (local transport), each agent dir
holding a metrics file of N records and a log of N lines, and a stand-in agent process so that
`status` asks the agents. Measured: `nebula status JOB --json` as a user runs it (the first call
builds the agents' summaries, the second finds them), and `nebula logs JOB --tail 10`.

    .venv/bin/python bench/status_reads.py [--records 1000000] [--small 1000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_cli.control.state import HostRecord, StateStore

REPO = Path(__file__).resolve().parent.parent
CLUSTER, HOST = "east", "e1"
BLOCK = 10_000  # records written per write call


def worker_line(i: int) -> str:
    """Line i of a worker's metrics, shaped like the GPT example's (sync every 50 steps)."""
    line = (f'{{"ts":{1.7e9 + i * 0.1},"step":{i},"cluster":"{CLUSTER}","host":"{HOST}",'
            f'"rank":0,"loss":{round(5.0 - i * 1e-6, 6)},"tokens_per_s":{1000.0 + i % 7},'
            f'"lr":0.001')
    if i % 100 == 0:
        line += f',"eval_loss":{round(5.1 - i * 1e-6, 6)}'
    if i % 50 == 0:
        line += (f',"outer_round":{i // 50},"round_s":0.5,"wan_bytes_sent":{i * 1000},'
                 f'"wan_bytes_received":{i * 900},"clusters_present":2')
    return line + "}"


def relay_line(i: int) -> str:
    """Line i of a relay's metrics, shaped like the relay's per-round line."""
    return (f'{{"ts":{1.7e9 + i * 5.0},"cluster":"{CLUSTER}","round":{i},"request_round":{i},'
            f'"round_s":0.25,"bytes_sent":1000,"bytes_received":1000,'
            f'"bytes_sent_total":{i * 1000},"bytes_received_total":{i * 1000},'
            f'"present":["east","west"],"missing":[],"rejected":[],"mode":"average",'
            f'"caught_up":false}}')


def log_line(i: int) -> str:
    return f"step {i} of a long run"


def worker_record(i: int) -> dict[str, Any]:
    return json.loads(worker_line(i))


def relay_record(i: int) -> dict[str, Any]:
    return json.loads(relay_line(i))


def write_lines(path: Path, n: int, make: Any) -> None:
    """A file of lines make(0) .. make(n - 1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for start in range(0, n, BLOCK):
            fh.write("".join(make(i) + "\n" for i in range(start, min(n, start + BLOCK))))


@dataclass
class RecordedJob:
    """A job as `launch` records it, with agent dirs whose files hold `records` lines."""

    home: Path
    job_id: str
    records: int
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)

    def close(self) -> None:
        for proc in self.agents:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def stand_in_agent(agent_dir: Path) -> subprocess.Popen[bytes]:
    """A process the agent's status command takes for the agent of agent_dir (its command line
    names the dir), so that `status` asks the agents as for a running job."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)",
                             str(agent_dir)], stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def recorded_job(home: Path, records: int, *, running: bool = True) -> Iterator[RecordedJob]:
    """A recorded job in NEBULA_HOME=home; its stand-in agents are ended on the way out."""
    spec = {"name": "long", "clusters": [{"name": CLUSTER, "hosts": [{"host": HOST}]}]}
    job = None
    try:
        with StateStore(home) as store:
            record = store.create_job("long", spec, None)
            job = RecordedJob(home=home, job_id=record.id, records=records)
            conn = {"transport": "local", "name": HOST, "home": str(home),
                    "python": sys.executable}
            for role, make in (("worker", worker_line), ("relay", relay_line)):
                rank = "0" if role == "worker" else "relay"
                agent_dir = home / "jobs" / record.id / f"{CLUSTER}-{HOST}-{role}"
                name = "rank0" if role == "worker" else "relay"
                write_lines(agent_dir / "metrics" / f"{name}.jsonl", records, make)
                write_lines(agent_dir / "logs" / f"{name}.log", records, log_line)
                (agent_dir / "agent.json").write_text(json.dumps({"processes": [
                    {"name": rank, "metrics": f"metrics/{name}.jsonl", "log": f"logs/{name}.log",
                     "argv": ["true"], "env": {}}]}))
                state, pid = "SUCCEEDED", None
                if running:
                    agent = stand_in_agent(agent_dir)
                    job.agents.append(agent)
                    state, pid = "RUNNING", agent.pid
                (agent_dir / "status.json").write_text(json.dumps({
                    "state": state, "agent_pid": pid, "pid": pid, "pgid": None,
                    "started": time.time(), "ended": None if running else time.time(),
                    "exit_code": None if running else 0, "restarts": 0}))
                job.dirs.append(agent_dir)
                store.upsert_host(HostRecord(
                    job_id=record.id, cluster=CLUSTER, host=HOST, role=role, node_rank=0,
                    slots=1, agent_dir=str(agent_dir), state="RUNNING", pid=pid,
                    detail={"conn": conn, "logs": {rank: f"logs/{name}.log"},
                            "metrics": {rank: f"metrics/{name}.jsonl"}}))
            store.set_job_state(record.id, "RUNNING")
        yield job
    finally:
        if job is not None:
            job.close()


def nebula(home: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    """(seconds, result) of one `nebula` command against NEBULA_HOME=home."""
    env = {**os.environ, "NEBULA_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nebula_cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"nebula {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return seconds, proc


def measure(records: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nebula-status-reads-") as tmp:
        made = time.perf_counter()
        with recorded_job(Path(tmp) / "home", records) as job:
            made = time.perf_counter() - made
            cold, proc = nebula(job.home, "status", job.job_id, "--json")
            warm, _ = nebula(job.home, "status", job.job_id, "--json")
            tail, _ = nebula(job.home, "logs", job.job_id, "--tail", "10")
            size = sum(p.stat().st_size for d in job.dirs for p in (d / "metrics").iterdir())
            shown = json.loads(proc.stdout)["metrics"][CLUSTER]
    return {"records": records, "metrics_bytes": size, "status_cold_s": round(cold, 3),
            "status_warm_s": round(warm, 3), "logs_tail_s": round(tail, 3),
            "step_shown": shown.get("step"), "setup_s": round(made, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    small, big = measure(args.small), measure(args.records)
    rows = [("records per metrics file", "records"), ("metrics bytes (2 files)", "metrics_bytes"),
            ("status --json, first (s)", "status_cold_s"),
            ("status --json, again (s)", "status_warm_s"), ("logs --tail 10 (s)", "logs_tail_s"),
            ("step shown", "step_shown")]
    print(f"{'':28}{'small':>14}{'big':>14}")
    for label, key in rows:
        print(f"{label:28}{small[key]:>14}{big[key]:>14}")
    ratio = big["status_cold_s"] / small["status_cold_s"]
    print(f"status time big/small: {ratio:.2f} (bounded reads: about 1)")
    if args.json:
        print(json.dumps({"small": small, "big": big, "status_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
