"""Shared helpers of the benchmarks that run jobs on this machine (local transport, no root):
bench/chaos.py, bench/hetero.py.

- `Cli`: the real CLI (`python -m nebula_cli`) as a subprocess against its own NEBULA_HOME.
- `records(home, job_id, role)`: the metrics JSON lines the job's workers (or relays) wrote (the
  local transport keeps a job's host directories under NEBULA_HOME).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GPT_DIR = REPO / "examples" / "gpt"


class Cli:
    def __init__(self, home: Path) -> None:
        self.env = {**os.environ, "NEBULA_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
        self.home = home

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nebula_cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, cwd=REPO,
                              stdin=subprocess.DEVNULL)

    def status(self, job_id: str) -> dict[str, Any]:
        return json.loads(self("status", job_id, "--json").stdout or "{}")


def records(home: Path, job_id: str, role: str = "worker") -> list[dict[str, Any]]:
    out = []
    for path in sorted((home / "jobs" / job_id).glob(f"*/*/{role}/metrics/*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out
