"""Shared helpers of the test-bed benchmarks (bench/wan_training.py, bench/relay_goodput.py).

- `make_bed(clusters, rate_mbit)`: a TestBed (tests/testbed) with no bastion; the caller uses it
  as a context manager, so every namespace, veth, sshd and process in it is removed at the end.
- `Nebula`: the real CLI (`python -m nebula_cli`) as a subprocess against a temporary NEBULA_HOME
  and the bed's ssh_config / known_hosts; `cleanup()` stops its jobs and removes their remote
  directories (`~/.nebula/jobs/<id>`: the bed's hosts share this machine's filesystem).
- `ssh_spec`: a job spec whose clusters are bed hosts reached by SSH.
- `worker_records` / `relay_records`: the metrics JSON lines the job wrote on the hosts.
- `link_bytes`: bytes that crossed between clusters, from the router's htb class counters.
- `say`, `table`, `emit_json`, `require_bed`: output and the root check.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REMOTE_JOBS = Path.home() / ".nebula" / "jobs"  # where the bed's hosts keep job files
GPT_DIR = REPO / "examples" / "gpt"


def testbed_module() -> Any:
    """tests/testbed, imported lazily (importing it needs no root; using it does)."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    import testbed

    return testbed


def require_bed() -> None:
    """Exit with status 2 and the reason when no test bed can be built here (not root, ...)."""
    ok, reason = testbed_module().TestBed.available()
    if not ok:
        print(f"cannot run: {reason}", file=sys.stderr)
        raise SystemExit(2)


def make_bed(clusters: dict[str, list[str]], rate_mbit: float | None, *, link: str = "pair",
             tcp: str | None = None) -> Any:
    """A TestBed (not yet up: use it as `with make_bed(...) as bed:`); `link` and `tcp` as in
    tests/testbed (a link per pair or a line per cluster; the hosts' congestion control)."""
    return testbed_module().TestBed(clusters, rate_mbit=rate_mbit, bastion=False, link=link,
                                    tcp=tcp)


def base_rtt_ms(bed: Any, src: str, dst: str) -> float:
    """Average ping round trip between two bed hosts in ms (the bed's own, without emulation)."""
    out = bed.run(src, ["ping", "-c", "3", "-i", "0.2", "-q", bed.hosts[dst].address],
                  timeout=20).stdout
    for line in out.splitlines():
        if "min/avg/max" in line:
            return float(line.split("=")[1].split("/")[1])
    return float("nan")


def link_bytes(bed: Any) -> int:
    """Bytes (IP packets with their link headers) routed between clusters so far: the sum of the
    router's htb leaf class counters on every `r<i>` (egress into cluster i, one leaf class per
    source cluster; a "cluster" bed's parent class, the line, is not counted twice). Management
    traffic (SSH from this namespace) is unclassified and not counted; an unshaped pair or line
    (rate None) has no class and counts 0. `set_rate` resets the counters."""
    total = 0
    for i in range(len(bed.clusters)):
        out = bed.run("router", ["tc", "-s", "class", "show", "dev", f"r{i}"],
                      check=True).stdout  # htb classes have no JSON output in tc
        blocks = [b for b in re.split(r"^(?=class )", out, flags=re.M) if b.strip()]
        parents = {m.group(1) for b in blocks if (m := re.match(r"class \S+ \S+ parent (\S+)", b))}
        for block in blocks:
            sent = re.search(r"^\s*Sent (\d+) bytes", block, re.M)
            if sent and block.split()[2] not in parents:
                total += int(sent.group(1))
    return total


def ssh_spec(path: Path, bed: Any, *, name: str, clusters: dict[str, list[str]], run: str,
             relay: dict[str, Any] | None = None, workdir: Path = GPT_DIR,
             deepspeed: str | dict[str, Any] | None = "ds_config.json") -> Path:
    """Write a job spec: every cluster `transport: ssh` over bed hosts, this python."""
    import yaml

    spec: dict[str, Any] = {
        "name": name, "workdir": str(workdir), "run": run,
        "env": {"OMP_NUM_THREADS": "1"},
        "clusters": [{"name": c, "transport": "ssh", "python": sys.executable,
                      "interface": bed.interface(hosts[0]),
                      "hosts": [{"host": h} for h in hosts]} for c, hosts in clusters.items()],
    }
    if deepspeed:
        spec["deepspeed"] = deepspeed
    if relay is not None:
        spec["relay"] = relay
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Nebula:
    """The nebula CLI in subprocesses, with its own NEBULA_HOME under `home`."""

    def __init__(self, bed: Any, home: Path) -> None:
        self.home = home
        self.env = {**os.environ, "NEBULA_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1",
                    "NEBULA_SSH_CONFIG": str(bed.ssh_config),
                    "NEBULA_KNOWN_HOSTS": str(bed.known_hosts)}

    def __call__(self, *args: str, timeout: float = 120, log: Path | None = None
                 ) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "nebula_cli", *args]
        if log is None:
            return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                                  timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
        with open(log, "w") as f:
            proc = subprocess.run(argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
        return subprocess.CompletedProcess(argv, proc.returncode, log.read_text(), "")

    def job_ids(self) -> list[str]:
        jobs = self.home / "jobs"
        return sorted(p.name for p in jobs.iterdir()) if jobs.is_dir() else []

    def run_job(self, spec: Path, *, timeout: float, log: Path) -> str:
        """`nebula launch spec` until the job ends; its id. RuntimeError (with the log's tail)
        when the launch or the job fails."""
        before = set(self.job_ids())
        try:
            proc = self("launch", str(spec), timeout=timeout, log=log)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{spec.name}: still running after {timeout:.0f}s; "
                               f"see {log}") from None
        new = sorted(set(self.job_ids()) - before)
        if proc.returncode != 0 or len(new) != 1:
            raise RuntimeError(f"{spec.name}: nebula launch exited {proc.returncode}:\n"
                               + proc.stdout[-3000:])
        return new[0]

    def cleanup(self) -> None:
        """Stop every job of this NEBULA_HOME (nothing left running) and remove its remote dir."""
        for job_id in self.job_ids():
            try:
                self("stop", job_id, "--force", timeout=120)
            except subprocess.TimeoutExpired:
                print(f"warning: nebula stop {job_id} timed out", file=sys.stderr)
            shutil.rmtree(REMOTE_JOBS / job_id, ignore_errors=True)


def _jsonl(paths: Sequence[Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line cut short by a kill
    return out


def worker_records(job_id: str) -> list[dict[str, Any]]:
    """Every metrics record of the job's workers (all clusters, hosts and ranks)."""
    return _jsonl(sorted((REMOTE_JOBS / job_id).glob("*/*/worker/metrics/*.jsonl")))


def relay_records(job_id: str) -> list[dict[str, Any]]:
    """Every per-round record of the job's relays."""
    return _jsonl(sorted((REMOTE_JOBS / job_id).glob("*/*/relay/metrics/*.jsonl")))


def say(text: str, indent: str = "") -> None:
    """A progress line on stderr, stamped with the time of day."""
    print(f"{indent}[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "-" if v is None else str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def emit_json(obj: dict[str, Any]) -> None:
    """Print one JSON object on one line (the last line of the output)."""
    print(json.dumps(obj, sort_keys=False), flush=True)
