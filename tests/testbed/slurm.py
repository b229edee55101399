"""A real Slurm cluster inside one cluster of the test bed (see bed.py for the topology).

`TestBed(..., slurm={"hpc": "login"})` makes host `login` of cluster `hpc` the login node and
controller (slurmctld runs in its namespace, its sshd stays) and every other host of `hpc` a
compute node (slurmd in its namespace, no sshd: compute nodes are not reachable by SSH, not in
the bed's `hosts`, ssh_config or known_hosts). `bed.slurm` describes the cluster (conf path,
nodes, partitions); its munged is killed by `down()` and `cleanup_stale()`.

Everything lives in `<bed dir>/slurm/`: slurm.conf, the controller's state, one spool dir and
pid file per node, the logs, the job completion log (jobcomp.txt), and a munge key with a
munged of the bed's own (root namespace, its own socket; slurm.conf's `AuthInfo=socket=...`
points clients and daemons at it). Nothing under /etc is read for the bed's Slurm except the
plugins; nothing under /etc is written. The login node's sshd sets `SLURM_CONF` for its
sessions, as /etc/slurm/slurm.conf would on a real login node.

Daemons are started with `nsenter --net=/var/run/netns/<ns>` (not `ip netns exec`, which mounts
a fresh /sys: slurmd then cannot find /sys/fs/cgroup). slurmctld also gets a UTS namespace of
its own whose hostname is the login node's name: slurmctld refuses to run on a host that is not
named in SlurmctldHost, and every namespace of this machine shares one hostname.

Nodes are what sites run (`CR_Core_Memory`; 8 CPUs and 4 fake GPUs declared per node, see
NODE_CPUS, NODE_GPUS). `TestBed(slurm_cgroup=True)` adds `proctrack/cgroup` and
`task/cgroup,task/affinity` with cores and devices confined: the kernel here mounts cgroup v1
(freezer, cpuset, devices, memory; cgroup2 only at /sys/fs/cgroup/unified), and slurmd names
its trees by node (`/sys/fs/cgroup/<controller>/slurm_<node>`), so several nodes share one
machine as long as node names differ across every bed that runs at once; `stop()` removes the
trees. The session bed keeps `proctrack/linuxproc`: its nodes are c1, c2 in every bed.

`kill_daemons()` kills slurmctld, the slurmds and the slurmstepds and leaves the steps' own
processes (a node's Slurm gone under a running job); `restart_fresh()` starts the daemons again
with their state emptied, so that job ids start again at FirstJobId.

The ports are Slurm's defaults (6817 slurmctld, 6818 slurmd): each daemon listens on its own
namespace's address, in a namespace no other bed or process uses, so they cannot collide.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import subprocess
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bed import Host

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scancel",
         "scontrol", "sacct", "nsenter", "unshare")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CTLD_PORT, SLURMD_PORT = 6817, 6818
NODE_CPUS, NODE_MEMORY_MB = 8, 4000
"""What each node declares (`slurmd -C` here says CPUs=2 RealMemory=24105): more CPUs than the
machine has, as a site's GPU node has more cores than one rank uses, so that jobs of several
ranks per node, `--cpus-per-task` and whole-node jobs get the shapes they get at a site.
`SlurmdParameters=config_overrides` makes slurmd take the declared counts (it would drain a
node that declares more than it finds)."""
FAKE_GPU_MAJOR = 240
"""The fake GPUs' device major: 240-254 are for local use, no driver answers (opening one fails
with ENXIO; a devices cgroup that denies it fails with EPERM)."""
NODE_GPUS = 4
"""Fake GPUs each node declares (`Gres=gpu:4`; in gres.conf, `File=` character devices in the
bed's dir, of major `FAKE_GPU_MAJOR`): Slurm schedules them (`--gpus-per-node`, `--gpus-per-task`,
SLURM_GPUS_ON_NODE) but no process sees a GPU. A gres.conf with `Count=` only does not do:
slurmd then reports 0 GPUs and the controller marks the node INVAL."""
PARTITIONS = {"debug": "01:00:00", "short": "00:05:00"}  # name -> MaxTime; the first is Default
ACTIVE_STATES = "PENDING,RUNNING,SUSPENDED,COMPLETING,CONFIGURING,REQUEUED,RESIZING,SIGNALING"
CGROUP_V1 = Path("/sys/fs/cgroup")
CGROUP_CONTROLLERS = ("freezer", "cpuset", "devices")
"""What proctrack/cgroup and task/cgroup use of cgroup v1 (the kernel here mounts v1)."""
START_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 30.0  # KillWait=5 plus slurmd's epilog round trip, with room to spare
LOG_TAIL = 15


def which(tool: str) -> str | None:
    """The tool's path; /usr/sbin is searched even when PATH lacks it (munged, slurmd)."""
    return shutil.which(tool) or shutil.which(tool, path=SBIN_PATH)


def available() -> tuple[bool, str]:
    """Whether the Slurm of the bed can run here: (True, "") or (False, the reason)."""
    missing = [tool for tool in TOOLS if which(tool) is None]
    if missing:
        return False, (f"{', '.join(missing)} not found (apt-get install slurmctld slurmd "
                       f"slurm-client munge)")
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _read_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):  # IndexError: being written
        pid = int(path.read_text().split()[0])
        if _pid_alive(pid):
            return pid
    return None


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"--- {path}: (no log)"
    return f"--- {path}:\n" + "\n".join(text)


def _marked_pids(bed_id: str) -> list[int]:
    """Pids whose command line names a file in the bed's slurm dir (munged, slurmctld, ...)."""
    mark = f"/{bed_id}/slurm/".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if mark in entry.joinpath("cmdline").read_bytes() and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found


def kill_root_daemons(bed_id: str, state: dict | None) -> None:
    """End the bed's daemons that live outside its namespaces (munged): the pid recorded in the
    state file, and any process whose command line names the bed's slurm dir."""
    from .system import _start_time, kill_pids

    pids = set(_marked_pids(bed_id))
    recorded = (state or {}).get("slurm", {}).get("munged")
    if isinstance(recorded, list) and len(recorded) == 2:
        pid, start = recorded
        if isinstance(pid, int) and _pid_alive(pid) and _start_time(pid) == start:
            pids.add(pid)
    kill_pids(sorted(pids))


def cgroup_available() -> tuple[bool, str]:
    """Whether slurmd can confine steps with cgroup v1 here: (True, "") or (False, why)."""
    missing = [c for c in CGROUP_CONTROLLERS if not (CGROUP_V1 / c / "tasks").exists()]
    if missing:
        return False, f"no cgroup v1 {', '.join(missing)} under {CGROUP_V1}"
    return True, ""


def remove_cgroups(nodes: Sequence[str]) -> None:
    """Remove the empty cgroups slurmd leaves (``/sys/fs/cgroup/<controller>/slurm_<node>``,
    by node name: slurmd runs several nodes on one machine, each with its own tree)."""
    for controller in CGROUP_CONTROLLERS:
        for node in nodes:
            root = CGROUP_V1 / controller / f"slurm_{node}"
            if not root.is_dir():
                continue
            for sub in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


class SlurmError(RuntimeError):
    """A Slurm daemon did not start, or a client command failed (message: logs' last lines)."""


class SlurmCluster:
    """The Slurm cluster of one bed cluster: controller on the login host, slurmd per node."""

    def __init__(self, bed_id: str, directory: Path, cluster: str, login: Host,
                 nodes: Sequence[Host], *, cgroup: bool = False) -> None:
        self.bed_id = bed_id
        self.dir = directory
        self.cluster = cluster
        self.cluster_name = bed_id  # ClusterName
        self.first_job_id = 1000 + zlib.crc32(f"{bed_id}/{cluster}".encode()) % 60_000_000
        """Job ids of their own (as sites' are): beds running at once share the home where the
        keepers' socket files are named by job id and node name (c1, c2 in every bed)."""
        self.login = login
        self.nodes = {node.name: node for node in nodes}
        self.partitions = dict(PARTITIONS)
        self.default_partition = next(iter(PARTITIONS))
        self.cgroup = cgroup
        """proctrack/cgroup and task/cgroup,task/affinity (most sites), cores and devices
        confined; else proctrack/linuxproc and task/none."""
        self.ctld_port = CTLD_PORT
        self.slurmd_port = SLURMD_PORT

    # ---------------------------------------------------------------------------- paths

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    @property
    def jobcomp_log(self) -> Path:
        return self.dir / "jobcomp.txt"

    def env(self) -> dict[str, str]:
        """The environment of a Slurm client of this cluster (SLURM_CONF, PATH with sbin)."""
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_",
                                                                           "SRUN_", "SALLOC_"))}
        return {**keep, "SLURM_CONF": str(self.conf), "PATH": SBIN_PATH}

    def _pidfile(self, daemon: str) -> Path:
        return self.dir / ("slurmctld.pid" if daemon == "slurmctld" else
                           "munge/munged.pid" if daemon == "munged" else f"d.{daemon}.pid")

    def _log(self, daemon: str) -> Path:
        return self.dir / ("slurmctld.log" if daemon == "slurmctld" else
                           "munge/munged.log" if daemon == "munged" else f"slurmd.{daemon}.log")

    def daemons(self) -> list[str]:
        """munged, slurmctld, then every node name (a node's daemon is its slurmd)."""
        return ["munged", "slurmctld", *self.nodes]

    def daemon_pids(self) -> dict[str, int | None]:
        return {d: _read_pid(self._pidfile(d)) for d in self.daemons()}

    def service_pids(self) -> set[int]:
        """The daemons and their helpers (slurmctld's child `slurmctld: slurmscriptd`)."""
        from .system import _cmdline, namespace_pids

        daemons = {p for p in self.daemon_pids().values() if p}
        helpers = {p for p in namespace_pids(self.login.ns) if _ppid(p) in daemons
                   and _cmdline(p).startswith("slurmctld: slurmscriptd")}
        return daemons | helpers

    def state(self) -> dict:
        """What the bed's state file records, so that cleanup_stale() finds munged."""
        from .system import _start_time

        pid = self.daemon_pids()["munged"]
        return {"conf": str(self.conf), "login": self.login.name,
                "munged": [pid, _start_time(pid)] if pid else None}

    def describe(self) -> dict:
        return {"cluster_name": self.cluster_name, "conf": str(self.conf),
                "login": self.login.name, "controller": f"{self.login.address}:{self.ctld_port}",
                "nodes": {n.name: n.address for n in self.nodes.values()},
                "partitions": self.partitions, "default_partition": self.default_partition}

    # --------------------------------------------------------------------------- files

    def write_files(self) -> None:
        for sub in ("state", "munge", *(f"spool{n}" for n in self.nodes)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "munge").chmod(0o755)  # munged wants it searchable; the bed dir is 0700
        key = self.dir / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.dir / "plugstack.conf").write_text("")  # not /etc/slurm's
        devices = self.dir / "dev"
        devices.mkdir(exist_ok=True)
        for name in self.nodes:
            for i in range(NODE_GPUS):  # character devices, as slurmd wants, of no driver
                with contextlib.suppress(FileExistsError):
                    os.mknod(devices / f"{name}-gpu{i}", 0o600 | stat.S_IFCHR,
                             os.makedev(FAKE_GPU_MAJOR, i))
        (self.dir / "gres.conf").write_text(  # beside slurm.conf, where slurmd looks for it
            "".join(f"NodeName={n} Name=gpu File={devices}/{n}-gpu[0-{NODE_GPUS - 1}]\n"
                    for n in self.nodes))
        (self.dir / "cgroup.conf").write_text(  # beside slurm.conf, where slurmd looks for it
            "CgroupPlugin=cgroup/v1\nConstrainCores=yes\nConstrainDevices=yes\n"
            "ConstrainRAMSpace=no\n")
        self.conf.write_text(self.config_text())

    def config_text(self) -> str:
        d = self.dir
        node_names = ",".join(self.nodes)
        lines = [
            f"# nebula test bed {self.bed_id}: Slurm of cluster {self.cluster}",
            f"ClusterName={self.cluster_name}", f"FirstJobId={self.first_job_id}",
            f"SlurmctldHost={self.login.name}({self.login.address})",
            f"SlurmctldPort={self.ctld_port}", f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            *(("ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity")
              if self.cgroup else
              ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none")),
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            f"DefMemPerCPU={NODE_MEMORY_MB // NODE_CPUS}",  # memory is scheduled, as at sites
            "SlurmdParameters=config_overrides", "GresTypes=gpu",
            "MpiDefault=none", f"PlugStackConfig={d / 'plugstack.conf'}", "MailProg=/bin/true",
            "ReturnToService=2", "KillWait=5", "InactiveLimit=0", "MinJobAge=300",
            "OverTimeLimit=0", "EnforcePartLimits=ALL",
            "SchedulerParameters=batch_sched_delay=0",  # a batch job starts ~1 s, not ~3 s, late
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.jobcomp_log}",
            "JobAcctGatherType=jobacct_gather/none",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d}/spool%n", f"SlurmdPidFile={d}/d.%n.pid",
            f"SlurmctldPidFile={self._pidfile('slurmctld')}",
            f"SlurmctldLogFile={self._log('slurmctld')}", f"SlurmdLogFile={d}/slurmd.%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            *(f"NodeName={n.name} NodeAddr={n.address} CPUs={NODE_CPUS} "
              f"RealMemory={NODE_MEMORY_MB} Sockets=1 CoresPerSocket={NODE_CPUS} ThreadsPerCore=1 "
              f"Gres=gpu:{NODE_GPUS} State=UNKNOWN" for n in self.nodes.values()),
            *(f"PartitionName={name} Nodes={node_names} MaxTime={limit} State=UP"
              + (" Default=YES" if name == self.default_partition else "")
              for name, limit in self.partitions.items()),
        ]
        return "\n".join(lines) + "\n"

    # ----------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start munged, slurmctld and every slurmd that is not running; wait until every node
        is idle (bounded; SlurmError with the logs' last lines otherwise)."""
        self.write_files()
        pids = self.daemon_pids()
        if pids["munged"] is None:
            self._start_munged()
        if pids["slurmctld"] is None:
            self._spawn(["nsenter", f"--net=/var/run/netns/{self.login.ns}", "unshare",
                         "--uts", "sh", "-ec", 'hostname "$1"; shift; exec "$@"', "sh",
                         self.login.name, which("slurmctld") or "slurmctld", "-f",
                         str(self.conf)], "slurmctld")
        for name, node in self.nodes.items():
            if pids[name] is None:
                self._spawn(["nsenter", f"--net=/var/run/netns/{node.ns}",
                             which("slurmd") or "slurmd", "-f", str(self.conf), "-N", name],
                            name)
        self.wait_idle(START_TIMEOUT_S)

    def _start_munged(self) -> None:
        m = self.dir / "munge"
        self._spawn([which("munged") or "munged", "--force", f"--key-file={m / 'munge.key'}",
                     f"--socket={self.munge_socket}", f"--pid-file={self._pidfile('munged')}",
                     f"--log-file={self._log('munged')}", f"--seed-file={m / 'munged.seed'}"],
                    "munged")
        self._wait(lambda: self.munge_socket.exists(), "munged's socket", ["munged"])

    def _spawn(self, argv: list[str], daemon: str) -> None:
        """Run a daemon's start command (it forks and returns); fail with its log if it does
        not leave a live pid file behind."""
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env=self.env())
        if proc.returncode != 0:
            raise SlurmError(f"{daemon} did not start ({' '.join(argv)} exited "
                             f"{proc.returncode}: {proc.stderr.strip()})\n" + self.logs([daemon]))
        self._wait(lambda: _read_pid(self._pidfile(daemon)) is not None, f"{daemon}'s pid file",
                   [daemon])

    def _wait(self, ready: Callable[[], bool], what: str, logs: Sequence[str],
              timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise SlurmError(f"no {what} after {timeout:g} s\n" + self.logs(logs))
            time.sleep(0.1)

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until sinfo shows every node idle."""
        last: dict[str, str] = {}

        def idle() -> bool:
            nonlocal last
            last = self.node_states()
            return set(last) == set(self.nodes) and all(s == "idle" for s in last.values())

        try:
            self._wait(idle, "idle nodes", self.daemons(), timeout)
        except SlurmError as exc:
            raise SlurmError(f"nodes not idle: {last or 'sinfo said nothing'}; {exc}") from None

    def logs(self, daemons: Sequence[str] | None = None) -> str:
        return "\n".join(_tail(self._log(d)) for d in (daemons or self.daemons()))

    def stop(self) -> None:
        """End every daemon (slurmds first, munged last) and the job steps they left."""
        from .system import kill_pids, namespace_pids

        pids = self.daemon_pids()
        kill_pids([p for d, p in pids.items() if p and d != "munged"])
        steps = [p for n in self.nodes.values() for p in namespace_pids(n.ns)]
        kill_pids(steps, grace=0.2)  # slurmstepd ignores SIGTERM
        kill_pids([p for p in [pids["munged"]] if p])
        kill_root_daemons(self.bed_id, None)
        if self.cgroup:
            remove_cgroups(list(self.nodes))

    # ------------------------------------------------------------------------- clients

    def client(self, *argv: str, timeout: float = 30, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (squeue, scancel, ...) from the root namespace."""
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, env=self.env())
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"timed out after {timeout:g} s: {' '.join(argv)}") from exc
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {proc.returncode}: "
                             f"{proc.stderr.strip()}")
        return proc

    def node_states(self) -> dict[str, str]:
        """Node name -> sinfo's short state (idle, mix, alloc, down*, drain, ...)."""
        out = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return dict(line.split(None, 1) for line in out.splitlines() if " " in line)

    def active_jobs(self) -> list[tuple[str, str, str]]:
        """(job id, state, name) of every job not finished yet."""
        out = self.client("squeue", "-h", "-t", ACTIVE_STATES, "-o", "%i|%T|%j").stdout
        return [tuple(line.split("|", 2)) for line in out.splitlines()  # type: ignore[misc]
                if line.count("|") == 2]

    def job_state(self, job_id: str) -> str:
        """squeue's state of a job, finished ones too (for MinJobAge); "" if squeue forgot it."""
        out = self.client("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T",
                          check=False).stdout
        return out.split()[0] if out.split() else ""

    def wait_state(self, job_id: str, states: Sequence[str], timeout: float = 30,
                   said: Path | None = None) -> str:
        """Wait until the job is in one of `states`; its state, or SlurmError after timeout
        with what Slurm knows of the job and its steps, the daemons' logs and the job's output
        file `said` (where the test knows it)."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in states:
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} is {state or 'unknown'}, not {'/'.join(states)} "
                                 f"after {timeout:g} s\n" + self._job_report(job_id, said))
            time.sleep(0.2)
        return state

    def _job_report(self, job_id: str, said: Path | None) -> str:
        steps = self.client("squeue", "-h", "-s", "-j", job_id, "-o", "%i %M %N",
                            check=False)
        job = self.client("scontrol", "show", "job", "-d", job_id, check=False)
        output = (said.read_text(errors="replace")[-4000:] if said is not None and said.exists()
                  else "(no output file)")
        return (f"steps:\n{steps.stdout}{steps.stderr}\n{job.stdout}{job.stderr}\n"
                f"output:\n{output}\n{self.logs()}")

    def cancel(self, *job_ids: str, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """scancel the jobs and wait until none of them is pending, running or completing."""
        if not job_ids:
            return
        self.client("scancel", *job_ids, check=False)
        deadline = time.monotonic() + timeout
        while {j for j, _, _ in self.active_jobs()} & set(job_ids):
            if time.monotonic() > deadline:
                raise SlurmError(f"jobs {', '.join(job_ids)} still active {timeout:g} s after "
                                 f"scancel")
            time.sleep(0.2)

    # ----------------------------------------------------------------- leaks and reset

    def leaks(self) -> list[str]:
        """Jobs not finished, nodes not idle, daemons not running."""
        found = [f"slurm daemon {d} not running" for d, p in self.daemon_pids().items()
                 if p is None]
        if found:
            return found
        try:
            jobs = self.active_jobs()
        except SlurmError as exc:
            return [f"squeue failed: {exc}"]
        found += [f"slurm job {job} ({name}) {state}" for job, state, name in jobs]
        if not jobs:
            found += [f"slurm node {n} is {s}" for n, s in self.node_states().items()
                      if s != "idle"]
        return found

    def reset(self) -> None:
        """Cancel every job of the cluster and wait until none is left running; bring back
        daemons that died and nodes that are down or drained."""
        if any(p is None for p in self.daemon_pids().values()):
            self.start()
        try:
            self.cancel(*(job for job, _, _ in self.active_jobs()))
        except SlurmError as exc:
            raise SlurmError(f"{exc}: {self.active_jobs()}\n" + self.logs()) from None
        bad = [n for n, s in self.node_states().items() if re.search(r"down|drain|fail", s)]
        if bad:
            self.client("scontrol", "update", f"NodeName={','.join(bad)}", "State=RESUME",
                        check=False)
        self.wait_idle(SETTLE_TIMEOUT_S)

    def stepds(self) -> list[int]:
        """The nodes' slurmstepd processes (one per running step, and its job's)."""
        from .system import namespace_pids

        return [p for n in self.nodes.values() for p in namespace_pids(n.ns)
                if _comm(p) == "slurmstepd"]

    def kill_daemons(self) -> None:
        """SIGKILL slurmctld (and its helper), every slurmd and every slurmstepd, as a node's
        Slurm dies (or is stopped with its steps' stepds): the steps' own processes are left as
        they are, for a test of what outlives its allocation. munged stays."""
        from .system import kill_pids

        pids = self.service_pids() - {self.daemon_pids()["munged"]}
        for pid in [*pids, *self.stepds()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_pids([*pids, *self.stepds()], grace=0.2)  # bounded wait; SIGKILL again if needed

    def restart_fresh(self) -> None:
        """The daemons started again with the controller's state and the nodes' spools
        emptied (a Slurm reinstalled, or its state lost): job ids start again at FirstJobId,
        node names stay. Whatever the old daemons ran is not touched."""
        self.kill_daemons()
        for sub in ("state", *(f"spool{n}" for n in self.nodes)):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
        self.start()

    def signal_daemon(self, daemon: str, sig: signal.Signals = signal.SIGTERM) -> None:
        """Send a signal to one daemon (a test of a controller or node going away)."""
        pid = self.daemon_pids()[daemon]
        if pid is not None:
            os.kill(pid, sig)
