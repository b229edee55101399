"""A host agent as a real detached process in a test: its folder (`make_dir`), start (`agent`),
`status`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def agent(*args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "nebula_cli.agent", *args], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def make_dir(tmp_path: Path, script: str, slots: int = 1, **config: Any) -> Path:
    d = tmp_path / "agent"
    d.mkdir()
    procs = [{"name": str(r), "argv": ["/bin/sh", "-c", script], "env": {"MY_RANK": str(r)},
              "log": f"logs/rank{r}.log", "metrics": None} for r in range(slots)]
    cfg = {"job_id": "t", "cluster": "c", "host": "h", "role": "worker", "cwd": str(tmp_path),
           "grace": 5, "max_restarts": 0, "restart_backoff": 0.2, "processes": procs,
           "rotation": {"max_bytes": 1 << 20, "keep": 2}, "world_secret": "", **config}
    (d / "agent.json").write_text(json.dumps(cfg))
    return d


def status(d: Path) -> dict[str, Any]:
    return agent("status", str(d))[0]
