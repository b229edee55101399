"""The peers' own virtual environments for bench/peers.py, made on first use and kept under
~/.cache/nebula-bench/venvs/<peer> (or $NEBULA_BENCH_VENVS).

Each peer pins what it needs (torchft: torch >= 2.7 and opentelemetry; hivemind: its own
protobuf, grpcio, pydantic and a bundled p2pd daemon), so neither is installed into nebula's
environment. Each venv gets torch 2.13.0 first (this machine's pip takes the CPU build from its
local wheel cache: no multi-GB CUDA download), then the peer at the version the bench pins, by
the ordinary pip client. A venv whose peer already imports at that version is used as it is.
`ensure(peer)` returns the venv's python, or raises `VenvError` with pip's tail: what failed,
so that the bench can print it in that peer's row.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    """A peer system as the bench installs it."""

    name: str
    requirement: str
    module: str
    version: str
    extras: tuple[str, ...] = ()
    """What the bench's worker needs beside the peer (numpy: the parameters' checksum)."""


PEERS = {
    "torchft": Peer("torchft", "torchft==0.2.0", "torchft", "0.2.0", ("numpy",)),
    "hivemind": Peer("hivemind", "hivemind==1.1.12", "hivemind", "1.1.12"),
}


class VenvError(RuntimeError):
    """A peer's venv could not be made (the message says which step failed and pip's output)."""


def root() -> Path:
    return Path(os.environ.get("NEBULA_BENCH_VENVS")
                or Path.home() / ".cache" / "nebula-bench" / "venvs")


def _base_python() -> str:
    """The interpreter the venvs are made from: this one's base (not nebula's venv)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise VenvError(f"{what}: still running after {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise VenvError(f"{what} exited {proc.returncode}:\n{tail}")


def installed(python: Path, peer: Peer) -> bool:
    """Whether the venv's python imports the peer at the pinned version."""
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
                            f"print(m.version({peer.name!r}))"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    extras = all(subprocess.run([str(python), "-c", f"import {x}"], capture_output=True,
                                timeout=120, stdin=subprocess.DEVNULL).returncode == 0
                 for x in peer.extras)
    return probe.returncode == 0 and probe.stdout.strip() == peer.version and extras


def ensure(name: str, say: object = print) -> Path:
    """The python of the peer's venv, made and filled if needed (a few minutes the first time)."""
    peer = PEERS[name]
    venv = root() / name
    python = venv / "bin" / "python"
    if installed(python, peer):
        return python
    say(f"{name}: making its venv in {venv} ({TORCH}, then {peer.requirement}) ...")
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([_base_python(), "-m", "venv", "--clear", str(venv)], f"python -m venv {venv}", 300)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, TORCH], f"pip install {TORCH} (into {venv})", 900)
    _run([*pip, peer.requirement, *peer.extras],
         f"pip install {' '.join([peer.requirement, *peer.extras])} (into {venv})", 1200)
    if not installed(python, peer):
        raise VenvError(f"{peer.requirement} installed into {venv} but "
                        f"importlib.metadata does not report {peer.version}")
    return python
