"""A cluster in the spec: its hosts, how they are reached, and how its relay meets the others'.

Re-exported by `nebula_cli.config.spec`; each field's default is defined here, once.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    create_model,
    field_validator,
    model_validator,
)

from nebula_cli.config.distill_spec import TeacherSpec
from nebula_cli.config.fields import EnvDict, HostName, Interface, Jump, Name, Program
from nebula_cli.config.hosts import HostSpec
from nebula_cli.config.roles.kind import ROLE_NAMES, RoleKind
from nebula_cli.config.schedulers.base import Scheduler
from nebula_cli.config.schedulers.registry import (
    SCHEDULERS,
    SchedulerName,
    scheduler_named,
    section_fields,
)
from nebula_cli.config.sections import SpecModel
from nebula_cli.config.yaml_positions import PathKey, problems_error

RESERVED_CLUSTER_NAMES = frozenset({"lib", "work", "pki"})
"""Names of what a job's directory holds beside its clusters' directories."""
_REMOTE_PATH = re.compile(r"^(?:~/|/)[A-Za-z0-9._/+@%-]{0,1000}$")


def _remote_path(value: str) -> str:
    if not _REMOTE_PATH.fullmatch(value) or "/../" in f"{value}/":
        raise ValueError(f"expected an absolute path or one starting with ~/ (letters, digits, "
                         f"'.', '_', '/', '+', '@', '%', '-'; no '..'), found {value!r}")
    return value


RemotePath = Annotated[str, AfterValidator(_remote_path)]


SSH_TRANSPORTS = ("ssh", "openssh")
"""The transports whose hosts are reached over SSH."""


class _ClusterHead(SpecModel):
    """A cluster's fields before its schedulers' sections (the spec's order)."""

    name: Name
    """Cluster name: 1-32 of a-z, 0-9, '-', '_', starting with a letter or digit."""
    transport: Literal["local", "ssh", "openssh"] = "ssh"
    """How commands reach the hosts: 'ssh' (nebula's own client, your ssh_config read as your
    `ssh` reads it), 'openssh' (your `ssh` itself over one master connection per host: for
    hosts that ask a one-time code or more than a key), or 'local' (processes on this
    machine)."""
    hosts: list[HostSpec]
    """The cluster's hosts; at least one."""
    gateway: HostName | None = None
    """The `host` of the host that runs the cluster's relay. Default: the first host."""
    jump: Jump | None = None
    """Bastion for SSH: [user@]host[:port] or an ssh_config alias. Default: none."""
    python: Program = "python3"
    """Interpreter on the hosts (local transport: sys.executable unless set explicitly)."""
    interface: Interface | None = None
    """Network interface for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME on every host."""
    env: EnvDict = Field(default_factory=dict, repr=False)
    """Environment merged over the job's `env` for this cluster."""
    relay_address: HostName | None = None
    """Address other clusters' relays dial (with relay_reach: ssh, the address their hosts SSH
    to). Default: the gateway's address, else its host."""
    max_restarts: int | None = Field(None, ge=0)
    """Restarts after a failure for this cluster's hosts (a flaky or preemptible site may
    need more). Default: the job's `max_restarts`."""
    relay_reach: Literal["inbound", "outbound", "ssh"] = "inbound"
    """How the relays meet this cluster's. 'inbound': other clusters' relays can dial its relay
    port. 'outbound': nothing reaches its relay port, but it can dial out (compute nodes, VMs
    behind a firewall or NAT): it dials every other cluster. 'ssh': its relay can neither be
    dialled nor dial out, but its host accepts SSH (only port 22 open): the other relays reach
    it through an SSH tunnel to that host (see `authorized_keys`)."""
    relay_on: Literal["node", "login"] = "node"
    """Slurm clusters: where the relay runs: 'node' (the allocation's first node) or 'login'
    (the login node, usually reachable where compute nodes are not)."""
    authorized_keys: RemotePath = "~/.ssh/authorized_keys"
    """The file this cluster's sshd reads its user's keys from (its AuthorizedKeysFile: ~, %h
    and %u as there; on a Slurm cluster, on the shared home). Only used when other relays
    reach this one through an SSH tunnel: each tunnel's key is added there for as long as the
    relay runs, limited to forwarding to the relay's port, with the job's certificates'
    expiry time."""
    scheduler: SchedulerName = "none"
    """'none': the hosts run the workers. 'slurm': the one host is the login node of a Slurm
    cluster; one batch job (see `slurm`) holds the nodes that run the workers."""


_SECTIONS = section_fields()
"""A scheduler's own section of a cluster (`slurm:`), one field each, made from the registry."""
_ClusterSections = create_model("_ClusterSections", __base__=_ClusterHead,
                                __module__=__name__, **_SECTIONS)


class ClusterSpec(_ClusterSections):  # type: ignore[misc,valid-type]
    """A group of hosts with a fast network between them: one DeepSpeed world, one relay."""

    role: Literal[ROLE_NAMES] = RoleKind.TRAIN.value  # type: ignore[valid-type]
    """What the cluster does: 'train' (its workers train and average with the other training
    clusters), or 'teacher' (its workers serve soft labels to the training clusters; see the
    job's `distill:`)."""
    run: str | None = Field(None, min_length=1)
    """The cluster's own command, instead of the job's `run` (a teacher's server). Default:
    the job's `run`."""
    teacher: TeacherSpec | None = None
    """role: teacher: the built-in server for a Hugging Face causal LM (instead of `run`)."""

    _login: HostSpec | None = PrivateAttr(None)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in RESERVED_CLUSTER_NAMES:
            raise ValueError(f"cluster name {name!r} is reserved (a job directory on each host "
                             f"holds {', '.join(sorted(RESERVED_CLUSTER_NAMES))} beside the "
                             "clusters' directories); choose another")
        return name

    @field_validator("hosts")
    @classmethod
    def _some_hosts(cls, hosts: list[HostSpec]) -> list[HostSpec]:
        if not hosts:
            raise ValueError("a cluster needs at least one host")
        return hosts

    @model_validator(mode="after")
    def _check_hosts(self) -> ClusterSpec:
        problems: list[tuple[PathKey, str]] = []
        seen: dict[tuple[str, int | None], int] = {}
        for i, host in enumerate(self.hosts):
            first = seen.setdefault((host.host, host.port), i)
            if first != i:
                port = f" port {host.port}" if host.port else ""
                problems.append((("hosts", i), f"duplicate host {host.host!r}{port} "
                                               f"(already hosts[{first}])"))
        names = [h.host for h in self.hosts]
        scheduling = self.scheduling
        problems += scheduling.problems(self)
        if self.relay_on == "login" and not scheduling.relay_on_login:
            login = [s for s in SCHEDULERS.values() if s.relay_on_login]
            problems.append((("relay_on",), (
                f"relay_on: login is for {' or '.join(s.title for s in login)} clusters "
                f"(scheduler: {' or '.join(s.name for s in login)}); here the relay runs on "
                "the `gateway` host")))
        if self.relay_reach == "ssh" and not self.over_ssh:
            problems.append((("relay_reach",), "relay_reach: ssh needs transport: ssh or openssh "
                                               "(the other relays reach this one through its "
                                               "host's sshd)"))
        for other in SCHEDULERS.values():  # a section of another scheduler than this one's
            if other is not scheduling and self.section(other.name) is not None:
                problems.append(((other.name,), f"`{other.name}:` needs `scheduler: "
                                                f"{other.name}` in this cluster"))
        problems += self._role_problems()
        if self.gateway is not None and self.gateway not in names:
            problems.append((("gateway",), f"gateway {self.gateway!r} is not one of this "
                                           f"cluster's hosts: {', '.join(names)}"))
        if problems:
            raise problems_error(problems)
        return self

    def _role_problems(self) -> list[tuple[PathKey, str]]:
        kind = self.kind
        if self.teacher is not None and not kind.serves_labels:
            return [(("teacher",), "`teacher:` is for a cluster with `role: teacher`")]
        if kind.serves_labels and self.teacher is not None and self.teacher.builtin \
                and self.run is not None:
            return [(("teacher",), "a teacher runs either its own `run` or the built-in "
                                   "server of `teacher: {model:}`; remove one")]
        if kind.serves_labels and self.teacher is not None and not self.teacher.builtin \
                and self.run is None:
            return [(("teacher",), "a teacher serving a checkpoint (`from_job`, "
                                   "`checkpoint`) needs its own `run:`: a script that "
                                   "rebuilds the model, loads it (nebula_cli.runtime.distill."
                                   "teacher_checkpoint) and calls nebula_cli.runtime.distill."
                                   "serve")]
        if kind.serves_labels and self.teacher is None and self.run is None:
            return [(("role",), "a teacher cluster needs its server: `run: <command>` (a "
                                "script calling nebula_cli.runtime.distill.serve) or "
                                "`teacher: {model: <Hugging Face model directory>}`")]
        return []

    @property
    def averages(self) -> bool:
        """Whether the cluster takes part in the outer rounds (its role's relay services hold
        `RelayService.AVERAGE`: `train`; tests/config/test_roles.py checks the two agree). A
        teacher's cluster runs no averaging relay."""
        return self.kind.averages

    @property
    def kind(self) -> RoleKind:
        """What its `role:` names, to be asked (`averages`, `serves_labels`, `trains`)."""
        return RoleKind(self.role)

    def section(self, name: str) -> SpecModel | None:
        """Its section of the scheduler `name` (`slurm:`), None when absent or when that
        scheduler has none."""
        return getattr(self, name) if name in _SECTIONS else None

    @property
    def scheduling(self) -> Scheduler:
        """What its `scheduler:` means for the spec and the plan (`config.schedulers`)."""
        return scheduler_named(self.scheduler)

    @property
    def node_count(self) -> int:
        """The hosts that run workers: the allocation's nodes on a Slurm cluster."""
        return self.scheduling.node_count(self)

    @property
    def process_count(self) -> int:
        """The cluster's DeepSpeed ranks."""
        return self.scheduling.process_count(self)

    @property
    def login_host(self) -> HostSpec | None:
        """The host a cluster whose hosts come from an allocation asks for it through (a
        Slurm cluster's login node: its one host as written, kept by `with_nodes`); None for
        other clusters."""
        if not self.scheduling.allocates:
            return None
        return self._login or self.hosts[0]

    @property
    def relay_host_known(self) -> bool:
        """Whether the relay's host is known before launch (not on a node of an allocation
        that does not run yet)."""
        return not self.scheduling.allocates or self.relay_on == "login"

    def with_nodes(self, hosts: list[HostSpec]) -> ClusterSpec:
        """This cluster with an allocation's nodes as its hosts, its login node kept."""
        out = self.model_copy(update={"hosts": hosts})
        out._login = self.login_host
        return out

    @property
    def gateway_host(self) -> HostSpec:
        """The host that runs this cluster's relay: `gateway` (default: the first host); on a
        Slurm cluster the allocation's first node, or with relay_on: login the login node."""
        login = self.login_host
        if login is not None and self.relay_on == "login":
            return login
        wanted = self.gateway or self.hosts[0].host
        return next(h for h in self.hosts if h.host == wanted)

    @property
    def over_ssh(self) -> bool:
        """Its hosts are reached over SSH (they have an sshd: tunnels can end there)."""
        return self.transport in SSH_TRANSPORTS

    @property
    def ssh_host(self) -> HostSpec:
        """The host other relays open an SSH tunnel to (relay_reach: ssh): a Slurm cluster's
        login node, else the relay's host."""
        return self.login_host or self.gateway_host

    @property
    def effective_relay_address(self) -> str:
        """The address other clusters' relays dial."""
        return self.relay_address or self.gateway_host.reach_address
