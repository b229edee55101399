"""What `nebula validate --hosts` learns of each host: reachable, python, torch, deepspeed, disk."""

from __future__ import annotations

import json
from dataclasses import dataclass

from nebula_cli.errors import NebulaError
from nebula_cli.transport import Transport

# Runs on the host under the cluster's python; standard library only; prints one JSON object.
PROBE = r"""
import importlib.metadata as md, json, os, platform, shutil, sys
def version(name):
    try:
        return md.version(name)
    except Exception:
        return None
home = os.path.expanduser(sys.argv[1])
probe = home
while not os.path.exists(probe):
    probe = os.path.dirname(probe)
print(json.dumps({"python": platform.python_version(), "torch": version("torch"),
                  "deepspeed": version("deepspeed"), "free_bytes": shutil.disk_usage(probe).free,
                  "cpus": os.cpu_count()}))
"""

MIN_FREE_BYTES = 1 << 30


@dataclass
class HostCheck:
    cluster: str
    host: str
    slots: int
    reachable: bool = False
    python: str | None = None
    torch: str | None = None
    deepspeed: str | None = None
    free_bytes: int | None = None
    error: str | None = None

    @property
    def problems(self) -> list[str]:
        """What keeps this host from running a job (empty when it is fine)."""
        if self.error:
            return [self.error]
        found = []
        if self.python is None:
            found.append("python not found")
        if self.torch is None:
            found.append("torch is not installed")
        if self.deepspeed is None:
            found.append("deepspeed is not installed")
        if self.free_bytes is not None and self.free_bytes < MIN_FREE_BYTES:
            found.append(f"only {self.free_bytes >> 20} MiB free")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems


def check_host(t: Transport, cluster: str, host: str, slots: int) -> HostCheck:
    """Connect, run the probe under the host's python, and report what was found."""
    check = HostCheck(cluster=cluster, host=host, slots=slots)
    try:
        result = t.run([t.python, "-c", PROBE, t.home], timeout=60)
    except NebulaError as exc:
        check.error = str(exc)
        return check
    check.reachable = True
    if result.exit_code == 127:
        check.error = f"python '{t.python}' not found on the host"
        return check
    try:
        found = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        check.error = f"the probe failed: {result}"
        return check
    check.python = found.get("python")
    check.torch = found.get("torch")
    check.deepspeed = found.get("deepspeed")
    check.free_bytes = found.get("free_bytes")
    return check
