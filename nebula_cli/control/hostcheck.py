"""What `nebula validate --hosts` learns of each host: reachable, python, torch, deepspeed, disk;
and `require_python`, the interpreter check provisioning makes on every host before it uploads.

nebula needs Python >= `MIN_PYTHON` on every host (the agent starts process groups with
`Popen(process_group=...)`, new in 3.11); an older interpreter is refused by name, with the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nebula_cli.errors import NebulaError, TransportError
from nebula_cli.launchers import launcher
from nebula_cli.transport import Transport

MIN_PYTHON = (3, 11)
"""Oldest Python nebula runs on, on the launching machine and on every host."""

# Runs on the host under the cluster's python; standard library only, and valid on old Pythons
# (no f-strings) so that an old interpreter still says what it is; prints one JSON object.
PROBE = r"""
import json, os, platform, shutil, sys
try:
    import importlib.metadata as md
except ImportError:
    md = None
def version(name):
    try:
        return md.version(name)
    except Exception:
        return None
home = os.path.expanduser(sys.argv[1])
probe = home
while not os.path.exists(probe):
    probe = os.path.dirname(probe)
def mem_available():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except Exception:
        return None
def read_limit(path):
    try:
        text = open(path).read().strip()
    except Exception:
        return None
    if text == "max" or not text.isdigit() or int(text) >= 1 << 60:
        return None
    return int(text)
def cgroup_limit():
    found = []
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except Exception:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2].rstrip("/")
        if parts[0] == "0":
            while True:
                found.append(read_limit("/sys/fs/cgroup" + path + "/memory.max"))
                if not path:
                    break
                path = path.rsplit("/", 1)[0]
        elif "memory" in parts[1].split(","):
            found.append(read_limit("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes"))
    found = [n for n in found if n is not None]
    return min(found) if found else None
print(json.dumps({"python": platform.python_version(), "torch": version("torch"),
                  "deepspeed": version("deepspeed"), "free_bytes": shutil.disk_usage(probe).free,
                  "cpus": os.cpu_count(), "mem_available": mem_available(),
                  "cgroup_limit": cgroup_limit()}))
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
    mem_available: int | None = None
    """MemAvailable of /proc/meminfo, in bytes (None: not Linux, or unreadable)."""
    cgroup_limit: int | None = None
    """The lowest memory limit of the probe's cgroup and its parents (v2 memory.max, v1
    memory.limit_in_bytes), None when unlimited."""
    error: str | None = None
    interpreter: str = "python"
    """The interpreter that was asked (the cluster's `python:`)."""
    scheduler: str | None = None
    """What the cluster's scheduler says it would give the spec (a Slurm login node:
    ``sbatch --test-only``'s answer), None for hosts that allocate nothing."""
    interface: str | None = None
    """GLOO/NCCL_SOCKET_IFNAME its ranks get: the spec's, or the one found toward its world's
    peers (None: a one-host world, loopback)."""
    reached: str | None = None
    """How it was reached (or tried): address, jump or proxy, ssh_config lines, auth."""

    @property
    def problems(self) -> list[str]:
        """What keeps this host from running a job (empty when it is fine)."""
        if self.error:
            return [self.error]
        found = []
        if self.python is None:
            found.append("python not found")
        elif (old := too_old(self.python, f"'{self.interpreter}'")) is not None:
            found.append(old)
        if self.torch is None:
            found.append("torch is not installed")
        if self.deepspeed is None:
            found.append("deepspeed is not installed")
        if self.free_bytes is not None and self.free_bytes < MIN_FREE_BYTES:
            found.append(f"only {self.free_bytes >> 20} MiB free")
        return found

    @property
    def memory_bytes(self) -> int | None:
        """What a job may use on the host: the lower of MemAvailable and the cgroup's limit."""
        known = [n for n in (self.mem_available, self.cgroup_limit) if n is not None]
        return min(known) if known else None

    @property
    def ok(self) -> bool:
        return not self.problems


def check_host(t: Transport, cluster: str, host: str, slots: int) -> HostCheck:
    """Connect, run the probe under the host's python, and report what was found."""
    check = HostCheck(cluster=cluster, host=host, slots=slots, interpreter=t.python)
    try:
        result = t.run([t.python, "-c", PROBE, t.home], timeout=60)
    except NebulaError as exc:
        check.error = str(exc)
        check.reached = t.reached_as()
        return check
    check.reachable = True
    check.reached = t.reached_as()
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
    check.mem_available = found.get("mem_available")
    check.cgroup_limit = found.get("cgroup_limit")
    return check


def _parse_version(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.strip().split(".")[:2])
    except ValueError:
        return None


def too_old(version: str, python: str = "python") -> str | None:
    """The problem with a host whose interpreter reports `version`, or None if it is recent
    enough (an unreadable version counts as too old)."""
    found = _parse_version(version)
    if found is not None and len(found) == 2 and found >= MIN_PYTHON:
        return None
    need = ".".join(map(str, MIN_PYTHON))
    return (f"{python} is Python {version or 'of an unknown version'}; nebula needs Python >= "
            f"{need}: install python{need} (or newer) on the host, e.g. `apt install "
            f"python{need}` or a conda/uv environment, and set the cluster's `python:` to it")


def require_python(t: Transport, cluster: str, host: str) -> None:
    """Refuse a host whose interpreter (`t.python`) is missing or older than MIN_PYTHON
    (`launchers/bootstrap.sh`). Raises TransportError naming the cluster/host, the version
    found and what to install."""
    bootstrap(t, f"{cluster}/{host}")


def bootstrap(t: Transport, where: str, modules: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> str:
    """Run `launchers/bootstrap.sh` on the host (the interpreter, then `modules` findable
    under `env`); the Python version found, or TransportError with the script's one line."""
    need = ".".join(map(str, MIN_PYTHON))
    result = t.run(["sh", "-s", "--", where, t.python, need, *modules], env=env,
                   stdin=launcher("bootstrap.sh"), timeout=60)
    lines = result.stdout.strip().splitlines()
    if result.ok and lines and lines[-1].startswith("ok "):
        return lines[-1].removeprefix("ok ")
    said = result.stderr.strip().splitlines()
    if result.exit_code == 3 and said:
        raise TransportError(said[-1].removeprefix(f"nebula: {where}: "), host=where)
    raise TransportError(f"cannot check the host: {result}", host=where)
