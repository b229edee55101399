"""Two (or more) real gloo ranks, each a Python process running a script given as text: the
ranks of one cluster for tests of what they share (runtime/cluster_share.py, runtime/final.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_ranks(script: str, store: Path, *args: str, ranks: int = 2,
              timeout: float = 120) -> list[Any]:
    """Run ``script`` as ranks 0..ranks-1 (``sys.argv``: rank, the file store's path,
    ``args``); each must exit 0 and print JSON as its last line: those values, by rank."""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(store), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(ranks)]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * ranks, outs
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
