"""The job spec: a YAML file validated into typed models, with errors that say where and why.

`load_spec(path)` / `parse_spec(text)` return a `JobSpec` or raise one `SpecError` whose
`.problems` lists every problem found, each with file, line, column, field path and a message
that says what was expected and what was found.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nebula_cli.config import pipeline
from nebula_cli.config import yaml_positions as yp
from nebula_cli.config.yaml_positions import PathKey, describe, problems_error
from nebula_cli.errors import SpecError

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOST_RE = re.compile(
    r"(?:(?P<user>[^@\s:]+)@)?(?P<host>\[[^\]\s]+\]|[^@\s:\[\]]+)(?::(?P<port>\d+))?")
_SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)


def _matching(regex: re.Pattern[str], expected: str) -> AfterValidator:
    """A validator that accepts strings matching `regex` and otherwise says what was expected."""

    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"expected {expected}, found {describe(value)}")
        return value

    return AfterValidator(check)


def _coerce_env(value: Any) -> Any:
    """YAML scalars (1, 0.5, true) become the strings a process environment holds."""
    def text(v: Any) -> Any:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, (int, float)) else v

    return {k: text(v) for k, v in value.items()} if isinstance(value, dict) else value


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of secret-looking keys replaced by ``***``."""
    return {k: "***" if _SECRET_RE.search(k) else v for k, v in env.items()}


Name = Annotated[str, _matching(_NAME_RE, "a name of 1-32 characters: lowercase letters, "
                                 "digits, '-' or '_', starting with a letter or digit")]
Port = Annotated[int, Field(ge=1, le=65535)]
EnvName = Annotated[str, _matching(_ENV_NAME_RE, "an environment variable name (letters, digits "
                                                 "and '_', not starting with a digit)")]
EnvDict = Annotated[dict[EnvName, str], BeforeValidator(_coerce_env)]
Jump = Annotated[str, _matching(_HOST_RE, "[user@]host[:port] or an ssh_config alias")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class HostSpec(_Model):
    """One machine of a cluster; may be written as ``host``, ``user@host`` or ``user@host:port``."""

    host: str = Field(min_length=1)
    """Hostname, address or ~/.ssh/config alias; for transport local just a label."""
    user: str | None = None
    """SSH user. Default: ssh_config's, else the local user."""
    port: Port | None = None
    """SSH port (1..65535). Default: ssh_config's, else 22."""
    slots: int = Field(1, ge=1)
    """Processes started on this host (typically one per GPU)."""
    key: str | None = None
    """Private key file for SSH; ~ is expanded. Default: the agent / ssh_config keys."""
    address: str | None = None
    """Address the cluster's other hosts reach this one at (DeepSpeed master). Default: host."""
    interface: str | None = None
    """Network interface for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME; overrides the cluster's."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        match = _HOST_RE.fullmatch(value.strip())
        if not match:
            raise ValueError(f"expected 'host', 'user@host' or 'user@host:port', found {value!r}")
        out: dict[str, Any] = {"host": match["host"].strip("[]")}
        if match["user"]:
            out["user"] = match["user"]
        if match["port"]:
            out["port"] = int(match["port"])
        return out

    @field_validator("key")
    @classmethod
    def _expand_key(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)

    @property
    def reach_address(self) -> str:
        """The address other hosts of the cluster use for this one."""
        return self.address or self.host


class ClusterSpec(_Model):
    """A group of hosts with a fast network between them: one DeepSpeed world, one relay."""

    name: Name
    """Cluster name: 1-32 of a-z, 0-9, '-', '_', starting with a letter or digit."""
    transport: Literal["local", "ssh"] = "ssh"
    """How commands reach the hosts: 'ssh', or 'local' (processes on this machine)."""
    hosts: list[HostSpec]
    """The cluster's hosts; at least one."""
    gateway: str | None = None
    """The `host` of the host that runs the cluster's relay. Default: the first host."""
    jump: Jump | None = None
    """Bastion for SSH: [user@]host[:port] or an ssh_config alias. Default: none."""
    python: str = "python3"
    """Interpreter on the hosts (local transport: sys.executable unless set explicitly)."""
    interface: str | None = None
    """Network interface for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME on every host."""
    env: EnvDict = Field(default_factory=dict, repr=False)
    """Environment merged over the job's `env` for this cluster."""
    relay_address: str | None = None
    """Address other clusters' relays dial. Default: the gateway's address, else its host."""

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
        if self.gateway is not None and self.gateway not in names:
            problems.append((("gateway",), f"gateway {self.gateway!r} is not one of this "
                                           f"cluster's hosts: {', '.join(names)}"))
        if problems:
            raise problems_error(problems)
        return self

    @property
    def gateway_host(self) -> HostSpec:
        """The host that runs this cluster's relay."""
        wanted = self.gateway or self.hosts[0].host
        return next(h for h in self.hosts if h.host == wanted)

    @property
    def effective_relay_address(self) -> str:
        """The address other clusters' relays dial."""
        return self.relay_address or self.gateway_host.reach_address


class SyncSpec(_Model):
    """How clusters combine their work over the WAN."""

    mode: Literal["diloco", "gradient"] = "diloco"
    """'diloco': average parameter deltas every inner_steps; 'gradient': every step."""
    inner_steps: int = Field(100, ge=1)
    """Local steps between outer syncs (diloco)."""
    outer_lr: float = Field(0.7, gt=0.0)
    """Outer optimizer learning rate (diloco)."""
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Outer SGD momentum in [0, 1) (diloco)."""
    nesterov: bool = True
    """Nesterov momentum for the outer step."""
    overlap: bool = False
    """Overlap the outer sync with the next inner steps (the average is applied once it has
    arrived, on top of the progress made meanwhile)."""
    overlap_steps: int | None = Field(None, ge=1)
    """Overlap: apply the average exactly this many inner steps after the round starts (waiting
    for it if needed; >= inner_steps: one round late). Default: as soon as it has arrived."""


class CompressionSpec(_Model):
    """How tensors are encoded on the WAN; also written as a codec name (``compression: int8``)."""

    codec: Literal["none", "fp16", "bf16", "int8"] = "int8"
    """Wire codec."""
    error_feedback: bool = True
    """Carry the quantisation error into the next round."""
    block_size: int = Field(256, ge=16)
    """Values per scale for int8."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"codec": value} if isinstance(value, str) else value


class ShapingSpec(_Model):
    """WAN emulation on the relay's peer links, for local runs and demos."""

    rate_mbit: float | None = Field(None, gt=0.0)
    """Bandwidth cap in Mbit/s. Default: none."""
    delay_ms: float = Field(0.0, ge=0.0)
    """One-way delay added to every peer message, in ms."""


class RelaySpec(_Model):
    """The per-cluster relay that joins clusters over the WAN (TLS, one per gateway)."""

    port: Port = 29400
    """Port relays listen on for peer relays."""
    worker_port: Port | None = None
    """Port the cluster's workers use to reach their relay. Default: port + 1."""
    sync: SyncSpec = Field(default_factory=SyncSpec)
    """Synchronisation scheme."""
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    """Wire codec."""
    timeout: float = Field(120.0, gt=0.0)
    """Seconds a round may take before the relay goes on with the clusters present."""
    heartbeat: float = Field(5.0, gt=0.0)
    """Seconds between liveness messages on peer links."""
    shaping: ShapingSpec | None = None
    """WAN emulation. Default: none."""

    @model_validator(mode="after")
    def _check_ports(self) -> RelaySpec:
        if self.worker_port == self.port:
            message = f"worker_port must differ from port (both are {self.port})"
            raise problems_error([(("worker_port",), message)])
        if self.worker_port is None and self.port == 65535:
            message = "port 65535 leaves no room for the default worker_port (port + 1)"
            raise problems_error([(("port",), message)])
        return self

    @property
    def effective_worker_port(self) -> int:
        """The port workers dial to reach their relay."""
        return self.worker_port or self.port + 1


class CheckpointSpec(_Model):
    """Where and how often workers checkpoint."""

    dir: str = "checkpoints"
    """Directory relative to the job dir on each host."""
    every: int | None = Field(None, ge=1)
    """Steps between checkpoints. Default: only at stop."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept."""


class ParallelismSpec(_Model):
    """How one model is split over the clusters' devices."""

    pipeline_stages: int = Field(1, ge=1)
    """Pipeline stages (DeepSpeed PipelineModule) over every slot of every cluster, in one
    DeepSpeed world spanning the clusters (no relay). 1: no pipeline (data parallel)."""


def _read_ds_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read DeepSpeed config {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"DeepSpeed config {path}: expected a JSON object, "
                         f"found {describe(data)}")
    return data


class JobSpec(_Model):
    """One training job: what to run, where, and how the clusters are joined."""

    name: Name
    """Job name: 1-32 of a-z, 0-9, '-', '_', starting with a letter or digit."""
    workdir: str = Field(".", validate_default=True)
    """Code directory, relative to the spec file; stored as an absolute path. Must exist."""
    setup: str | None = None
    """Shell run once per host before start (e.g. pip install). Default: none."""
    run: str = Field(min_length=1)
    """Shell command every process (one per slot) runs, in the workdir."""
    env: EnvDict = Field(default_factory=dict, repr=False)
    """Environment for every process; numbers and booleans become strings."""
    deepspeed: str | dict[str, Any] | None = None
    """DeepSpeed config: a JSON path relative to workdir, or an inline mapping. Default: none."""
    clusters: list[ClusterSpec]
    """The clusters; at least one."""
    relay: RelaySpec | None = None
    """Relay settings. Default: none (clusters train independently)."""
    checkpoint: CheckpointSpec | None = None
    """Checkpoint settings. Default: none."""
    parallelism: ParallelismSpec | None = None
    """Pipeline parallelism across the clusters. Default: none (data parallel, per cluster)."""
    placement: str | None = None
    """Which device holds which stage: the JSON of `nebula plan placement --json`, relative to
    the spec file; stored as an absolute path. Default: ranks in the spec's host order."""
    max_restarts: int = Field(0, ge=0)
    """How often a host agent restarts its processes after a failure."""
    grace: float = Field(10.0, ge=0.0)
    """Seconds `stop` waits before SIGKILL."""
    exclude: list[str] = Field(
        default_factory=lambda: [".git", ".venv", "__pycache__", "*.pyc", ".nebula"])
    """Patterns in workdir not uploaded."""

    _source: str | None = PrivateAttr(None)
    _layout: pipeline.PipelineLayout | None = PrivateAttr(None)

    @field_validator("workdir")
    @classmethod
    def _resolve_workdir(cls, value: str, info: ValidationInfo) -> str:
        base = Path((info.context or {}).get("base_dir") or Path.cwd())
        resolved = (base / Path(value).expanduser()).resolve()
        if not resolved.is_dir():
            raise ValueError(f"workdir {value!r} is not an existing directory "
                             f"(looked for {resolved})")
        return str(resolved)

    @field_validator("placement")
    @classmethod
    def _resolve_placement(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        base = Path((info.context or {}).get("base_dir") or Path.cwd())
        return str((base / Path(value).expanduser()).resolve())

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _deepspeed_shape(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (str, dict)):
            raise ValueError("expected a path to a DeepSpeed config JSON or an inline mapping, "
                             f"found {describe(value)}")
        if isinstance(value, dict) and (bad := [k for k in value if not isinstance(k, str)]):
            raise ValueError(f"expected string keys in the DeepSpeed mapping, found {bad[0]!r}")
        return value

    @field_validator("clusters")
    @classmethod
    def _some_clusters(cls, clusters: list[ClusterSpec]) -> list[ClusterSpec]:
        if not clusters:
            raise ValueError("a job needs at least one cluster")
        return clusters

    @model_validator(mode="after")
    def _cross_checks(self) -> JobSpec:
        problems: list[tuple[PathKey, str]] = []
        names: dict[str, int] = {}
        owners: dict[tuple[str, int | None, str | None], tuple[int, int]] = {}
        for ci, cluster in enumerate(self.clusters):
            first = names.setdefault(cluster.name, ci)
            if first != ci:
                problems.append((("clusters", ci, "name"), (
                    f"duplicate cluster name {cluster.name!r} (also clusters[{first}])")))
            for hi, host in enumerate(cluster.hosts if cluster.transport == "ssh" else []):
                oc, oh = owners.setdefault((host.host, host.port, host.user), (ci, hi))
                if oc != ci:
                    problems.append((("clusters", ci, "hosts", hi), (
                        f"host {host.host!r} is also in cluster {self.clusters[oc].name!r} "
                        f"(clusters[{oc}].hosts[{oh}]); a host belongs to one cluster")))
        if isinstance(self.deepspeed, str):
            try:
                _read_ds_config(Path(self.workdir) / self.deepspeed)
            except ValueError as exc:
                problems.append((("deepspeed",), str(exc)))
        problems += self._check_pipeline()
        if problems:
            raise problems_error(problems)
        return self

    def _check_pipeline(self) -> list[tuple[PathKey, str]]:
        """Pipeline parallelism: no relay, stages that divide the devices, a placement that
        names every device once. Sets the layout the launcher follows."""
        stages = self.pipeline_stages
        if stages == 1:
            if self.placement is not None:
                return [(("placement",), "a placement needs parallelism: {pipeline_stages: K} "
                                         "with K >= 2")]
            return []
        if self.relay is not None:
            return [(("relay",), "pipeline parallelism runs one DeepSpeed world across the "
                                 "clusters and does not use the relay; remove 'relay:'")]
        devices = self.device_ids()
        try:
            pipeline.check_shape(len(devices), stages)
        except pipeline.PlacementError as exc:
            return [(("parallelism", "pipeline_stages"), str(exc))]
        if self.placement is None:
            self._layout = pipeline.default_layout(devices, stages)
            return []
        try:
            data = pipeline.read_placement(self.placement)
            self._layout = pipeline.layout_from_placement(data, devices, stages)
        except pipeline.PlacementError as exc:
            return [(("placement",), str(exc))]
        return []

    @property
    def pipeline_stages(self) -> int:
        """K of ``parallelism.pipeline_stages`` (1 without pipeline parallelism)."""
        return self.parallelism.pipeline_stages if self.parallelism else 1

    def device_ids(self) -> list[str]:
        """Every slot of every host, ``<cluster>/<host>/<slot>``, in the spec's order."""
        return [pipeline.device_id(c.name, h.host, s)
                for c in self.clusters for h in c.hosts for s in range(h.slots)]

    def pipeline_layout(self) -> pipeline.PipelineLayout | None:
        """Which device holds which stage of which replica; None without a pipeline."""
        return self._layout

    @property
    def source(self) -> str | None:
        """The spec file this was loaded from, if any."""
        return self._source

    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed config as a dict (read from the file, or the inline mapping)."""
        if self.deepspeed is None or isinstance(self.deepspeed, dict):
            return copy.deepcopy(self.deepspeed)
        try:
            return _read_ds_config(Path(self.workdir) / self.deepspeed)
        except ValueError as exc:
            raise SpecError(str(exc), file=self.source, field="deepspeed") from exc

    def redacted_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """`env` (default: the job's) with secret-looking values shown as ``***``."""
        return redact_env(self.env if env is None else env)


def parse_spec(text: str, file: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate spec text; `base_dir` anchors a relative workdir (default: the file's dir)."""
    if base_dir is None:
        base_dir = Path(file).parent if file != "<spec>" else Path.cwd()
    try:
        located = yp.load_located(text)
    except yaml.YAMLError as exc:
        raise yp.collect([yp.yaml_problem(exc, file)], file) from exc
    data = located.data
    if not isinstance(data, dict):
        message = (
            "the spec is empty; expected a mapping with at least 'name', 'run' and 'clusters'"
            if data is None else f"expected a mapping (name:, run:, clusters:, ...) at the top "
            f"level, found {describe(data)}")
        raise yp.collect([yp.problem(file, located.position(()), (), message)], file)
    problems = [yp.problem(file, d.at, d.path, f"duplicate key {d.path[-1]!r} "
                                               f"(first at line {d.first[0]})")
                for d in located.duplicates]
    try:
        spec = JobSpec.model_validate(data, context={"base_dir": Path(base_dir)})
    except ValidationError as exc:
        problems += yp.validation_problems(exc, located, file, JobSpec)
    if problems:
        raise yp.collect(problems, file)
    spec._source = None if file == "<spec>" else file
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file."""
    file, resolved = str(path), Path(path).expanduser()
    try:
        text = resolved.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise yp.collect([SpecError("cannot read the spec: no such file", file=file)],
                         file) from exc
    except IsADirectoryError as exc:
        raise yp.collect([SpecError("cannot read the spec: it is a directory, expected a YAML "
                                    "file", file=file)], file) from exc
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise yp.collect([SpecError(f"cannot read the spec: {reason}", file=file)],
                         file) from exc
    return parse_spec(text, file=file, base_dir=resolved.resolve().parent)
