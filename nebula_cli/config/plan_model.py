"""The job plan's data: what each host reports (`Site`), the ports and certificates found for
the job, and the agents to start (`AgentPlan`, `JobPlan`); where an agent's files live.

Re-exported by `nebula_cli.config.jobplan`, which builds a `JobPlan` from a spec.
"""

from __future__ import annotations

import datetime as dt
import posixpath
from dataclasses import dataclass, field
from typing import Protocol

from nebula_cli.config.parts import AgentConfig
from nebula_cli.config.relay_config import TlsFiles

WORKER = "worker"
RELAY = "relay"
RELAY_RESTARTS = 3
"""A relay is restarted this often at least: a cluster whose relay died rejoins and catches up."""
RELAY_GRACE = 5.0
"""Seconds a relay gets between SIGTERM and SIGKILL (it has no state worth saving)."""
RELAY_RESTART_BACKOFF = 1.0
WORKER_RESTART_BACKOFF = 5.0
WORKER_SOCKET = "worker.sock"
"""The relay's Unix socket for workers on its own host, in the relay's directory."""


class HostConn(Protocol):
    """How to reach a host: a transport's typed connection description (a `transport.Conn`,
    which the control plane makes, opens and records; the plan may not import the transports).
    The plan carries it without looking inside; it only names where nebula_cli is on hosts
    that do not share our files."""

    name: str

    def with_pythonpath(self, path: str) -> HostConn: ...


@dataclass(frozen=True)
class SshLogin:
    """How nebula reached a host's sshd, and the host key it verified there: what other
    clusters' relay hosts need to open an SSH tunnel to it (`reach`)."""

    user: str
    port: int
    host_key: str
    """"<type> <base64>", as nebula verified it against known_hosts."""


@dataclass(frozen=True)
class Site:
    """What a host's transport reports about it (see `Transport`)."""

    conn: HostConn
    """How to reach the host (`transport.describe`); kept in the state store."""
    home: str
    """Absolute path of nebula's directory on the host (jobs live in home/jobs)."""
    address: str
    """The address other hosts use for this one."""
    bind: str
    """The address services on this host listen on."""
    python: str
    """The interpreter processes run under."""
    shares_files: bool
    """The host sees this machine's files at the same paths: the workdir is used in place."""
    interface: str | None = None
    """The interface the host reaches the rest of its DeepSpeed world through (asked of hosts
    of multi-host worlds whose spec names none: see `route_targets`); GLOO/NCCL_SOCKET_IFNAME."""
    ssh: SshLogin | None = None
    """The host's sshd as nebula reached it (SSH transports only)."""


@dataclass(frozen=True)
class Ports:
    """Ports found free on the hosts that listen."""

    masters: dict[str, int]
    """DeepSpeed world (a cluster's name, or PIPELINE_WORLD) -> rendezvous port of its rank 0."""
    relays: dict[str, tuple[int, int]]
    """cluster -> (peer port, worker port) of its relay."""
    labels: dict[str, int] = field(default_factory=dict)
    """teacher cluster -> the port of its label relay on its gateway (`distill_plan`)."""


@dataclass(frozen=True)
class Certs:
    """The job's PEM files, as bytes: the CA certificate and one pair per relay and host."""

    ca: bytes
    relays: dict[str, tuple[bytes, bytes]]
    """cluster -> (certificate, key) of its relay."""
    workers: dict[str, tuple[bytes, bytes]]
    """"cluster/host" -> (certificate, key) of that host's workers."""
    tunnel_keys: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    """link ("dialer>dialled") -> its SSH tunnel's key: (OpenSSH private key, public key
    line), made for this attempt of the job."""
    expires: dt.datetime | None = None
    """When the job's certificates expire (UTC): tunnel keys are refused after it too."""


@dataclass(frozen=True, eq=False)
class AgentPlan:
    """One agent to start: a role (worker or relay) on one host of one cluster (hashed by
    identity: fan-outs key their results by it)."""

    cluster: str
    host: str
    role: str
    node_rank: int
    slots: int
    conn: HostConn
    job_root: str
    """The job's directory on that host."""
    config: AgentConfig
    files: dict[str, bytes] = field(default_factory=dict)
    """Files to write beside agent.json (mode 0600), relative to the agent's directory."""
    uploads: dict[str, str] = field(default_factory=dict)
    """Local directory -> where it goes on the host (empty when the host shares our files)."""
    tensorboard: str | None = None
    """Where this host writes its cluster's TensorBoard run (spec: metrics.tensorboard)."""
    files_from_first_host: bool = False
    """The host sees the files of its cluster's first host (the nodes of a scheduler whose
    nodes share a file system): nothing is uploaded to it, and it is provisioned after that
    host."""

    @property
    def agent_dir(self) -> str:
        return agent_dir(self.job_root, self.cluster, self.host, self.role)

    @property
    def key(self) -> str:
        return f"{self.cluster}/{self.host}/{self.role}"

    def __str__(self) -> str:
        return self.key

    @property
    def logs(self) -> dict[str, str]:
        """rank (or role name) -> log path relative to the agent dir."""
        return {p.name: p.log for p in self.config.processes}

    @property
    def metrics(self) -> dict[str, str]:
        """rank (or role name) -> metrics path relative to the agent dir."""
        return {p.name: p.metrics for p in self.config.processes if p.metrics}


@dataclass(frozen=True)
class JobPlan:
    """Every agent of a job, relays first (workers find them running)."""

    job_id: str
    agents: tuple[AgentPlan, ...]

    def role(self, role: str) -> list[AgentPlan]:
        return [a for a in self.agents if a.role == role]

    @property
    def hosts(self) -> list[AgentPlan]:
        """One agent per host that runs workers: where provisioning happens."""
        return self.role(WORKER)


def agent_dir(job_root: str, cluster: str, host: str, role: str) -> str:
    return posixpath.join(job_root, cluster, host, role)


def cert_names(role: str) -> tuple[str, str, str]:
    """Where a role's PEM files go, relative to its agent dir: the job's CA certificate, the
    role's certificate and key (the plan writes them there; its TLS paths point there)."""
    return "certs/ca.pem", f"certs/{role}.pem", f"certs/{role}.key"


def tls_files(adir: str, role: str) -> TlsFiles:
    ca, cert, key = (posixpath.join(adir, name) for name in cert_names(role))
    return TlsFiles(ca=ca, cert=cert, key=key)


def lib_dir(job_root: str) -> str:
    """Where the nebula_cli package is uploaded on a host that does not share our files."""
    return posixpath.join(job_root, "lib")


def conn_of(site: Site, job_root: str) -> HostConn:
    """The site's connection, with where nebula_cli lives when it is uploaded."""
    if site.shares_files:
        return site.conn
    return site.conn.with_pythonpath(lib_dir(job_root))


def base_env(site: Site, job_root: str, user: dict[str, str] | None = None) -> dict[str, str]:
    """``user`` (the spec's `env` and the cluster's) and what nebula adds: `python` in a command
    is the site's, nebula_cli is importable there (its uploaded folder first on PYTHONPATH, the
    user's PYTHONPATH after it), and a process that dies in native code (SIGSEGV, SIGABRT)
    leaves every thread's Python stack in its log (unless ``user`` says otherwise)."""
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(user or {})}
    if posixpath.isabs(site.python):  # the agent puts it first on PATH
        env["NEBULA_PATH_PREPEND"] = posixpath.dirname(site.python)
    if not site.shares_files:
        env["PYTHONPATH"] = ":".join(p for p in (lib_dir(job_root), env.get("PYTHONPATH")) if p)
    return env


def job_root_of(site: Site, job_id: str) -> str:
    """The job's directory on a host."""
    return job_root_in(site.home, job_id)


def job_root_in(home: str, job_id: str) -> str:
    """The job's directory on a host whose home is ``home``."""
    return posixpath.join(home, "jobs", job_id)
