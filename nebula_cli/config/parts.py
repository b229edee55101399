"""The parts of the job plan that host-side processes load: the agent's (`agent.json`) and the
training runtime's (`sync.json`). The relay's part is `relay_config.RelayConfig`.

Standard library only (the agent runs on hosts before anything else is known to work). No
field has a default: the plan fills every value from the spec, where the defaults live.
Each part is written next to its process with mode 0600; the environment only says where.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from nebula_cli.config import strict
from nebula_cli.config.relay_config import AutoSteps, TlsFiles
from nebula_cli.config.rotation import Rotation

ABORT_EXIT = 75
"""Exit status of a rank that left its world because another host's rank failed
(`nebula_cli.runtime.worldwatch`); its agent does not tell the world again."""
ENDED_ENV = "NEBULA_ENDED_FILE"
"""The file a worker agent names to each of its ranks: the rank's runtime hook creates it as the
last of the process's exit handlers, once the script returned without an uncaught exception
(`nebula_cli.runtime.hook`). A rank that then aborts in the interpreter's finalization (SIGABRT,
a backend's thread torn down: `nebula_cli.runtime.settle`) has ended its work: its agent does not
restart it into a world whose other ranks may be gone."""
WORLD_SECRET_ENV = "NEBULA_WORLD_SECRET"
"""The environment variable in which a worker agent hands its ranks (and its world teller) the
job's world secret (`AgentConfig.world_secret`): in the environment, never on a command line."""
LEAVE_SIGNAL = signal.SIGUSR1
"""What a relay's agent sends it, just before SIGTERM, when its cluster leaves the job for good
(`agent stop --leave`: nebula dropped the cluster under `min_clusters`): the relay then tells its
peers that it left, and they do not wait for it at the end. A plain SIGTERM (`nebula stop`, a
host shutting down, a scheduler's notice) leaves them waiting for it to come back."""
SYNC_CONFIG_ENV = "NEBULA_SYNC_CONFIG"
"""The environment variable that names a worker's sync.json."""
SHM = Path("/dev/shm")
"""Host memory as a filesystem: checkpoints are staged there (and DeepSpeed's comm buffers)."""


@dataclass(frozen=True)
class ProcessConfig:
    """One process an agent runs: a worker rank, or the relay."""

    name: str
    """The rank ("0", "1", ...) or the role ("relay"); names its log and exit code."""
    argv: list[str]
    env: dict[str, str]
    log: str
    """Log file, relative to the agent's directory."""
    metrics: str | None
    """Metrics file (JSON lines), relative to the agent's directory."""


@dataclass(frozen=True)
class AgentConfig:
    """`agent.json`: what one host agent supervises."""

    job_id: str
    cluster: str
    host: str
    role: str
    """"worker" or "relay"."""
    cwd: str
    grace: float
    """Seconds between SIGTERM and SIGKILL when the group is ended."""
    max_restarts: int
    restart_backoff: float
    """Seconds between a failure and the restart."""
    processes: list[ProcessConfig]
    rotation: Rotation
    """How big each of its files may grow (spec: logs): the processes' logs, their metrics
    records (the agent hands it to them in ``$NEBULA_ROTATION``), its own log and events."""
    world_secret: str
    """A worker's: the secret, drawn at launch for each attempt of the job, that an abort in
    its world's rendezvous store must carry (`nebula_cli.runtime.worldwatch`); the agent hands
    it to its ranks in ``$NEBULA_WORLD_SECRET``. "" (a relay's): no abort is taken or sent."""

    @classmethod
    def load(cls, path: str | Path) -> AgentConfig:
        return strict.load(cls, path)


CHECKPOINT_MARKER = "COMPLETE"
"""Written last into a checkpoint: a tag without it is never loaded."""
CHECKPOINT_TAG_PREFIX = "step"
"""A checkpoint's tag: this, then its step."""


def checkpoint_tag(step: int) -> str:
    """The tag of the checkpoint of ``step``."""
    return f"{CHECKPOINT_TAG_PREFIX}{step}"


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often a worker checkpoints (spec: checkpoint); read by
    `nebula_cli.runtime.checkpoint` (which stages in memory first: `config.staging`)."""

    dir: str
    """Absolute path on the host of this host's checkpoints (one per cluster and host)."""
    every: int | None
    """Optimizer steps between checkpoints; None: only the final one (end or graceful stop)."""
    keep: int
    """Complete checkpoints kept on the host."""


@dataclass(frozen=True)
class SyncConfig:
    """`sync.json`: how a worker reaches its relay and runs the outer loop (spec: relay.sync,
    relay.compression, relay.timeout, checkpoint)."""

    job_id: str
    cluster: str
    relay_addr: str
    """host:port of the cluster's relay (its worker port, mutual TLS)."""
    relay_socket: str | None
    """The relay's Unix socket when this host runs the cluster's relay (`RelayConfig.
    worker_socket`): rank 0 connects there without TLS, and to relay_addr when it is not there;
    None on the other hosts."""
    tls: TlsFiles
    mode: str
    """"diloco" or "gradient"."""
    inner_steps: int
    """H: optimizer steps between rounds (with ``auto_steps``, the first round's H)."""
    every_s: float | None
    """Time-based rounds: seconds of training between rounds (then inner_steps is unused)."""
    auto_steps: AutoSteps | None
    """``inner_steps: auto``: each round's result says the next H (chosen by the relays)."""
    outer_lr: float
    outer_momentum: float
    """The first round's outer lr and momentum (its codec's)."""
    outer_by_codec: dict[str, list[float]]
    """[outer lr, momentum] of a round by the codec it used (``compression: auto`` changes the
    codec between rounds; each codec has its own outer settings unless the spec names them)."""
    nesterov: bool
    overlap: bool
    overlap_steps: int | None
    codec: str
    """The WAN codec, or "auto" (the relay's business; the worker's hop to the relay is
    fp32)."""
    error_feedback: bool
    round_timeout: float
    """Seconds a round may take before the relay goes on with the clusters present."""
    checkpoint: CheckpointSettings | None
    """None: the spec has no `checkpoint:` section (no checkpoints)."""

    @classmethod
    def load(cls, path: str | Path) -> SyncConfig:
        return strict.load(cls, path)


METRICS_CONFIG_ENV = "NEBULA_METRICS_CONFIG"
"""The environment variable that names metrics.json: set only for the process that writes its
cluster's runs (the cluster's first rank)."""
METRICS_FILE_ENV = "NEBULA_METRICS_FILE"
"""The environment variable that names a rank's metrics.jsonl (set for each rank)."""
RUNTIME_HOOK_DIR = ("runtime", "autohook")
"""The automatic hook's directory in the nebula_cli package (first on a rank's PYTHONPATH)."""


def helper_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (a rank's) for a process of the job that is not a training rank: the setup
    command, the host check, the agent's world teller. The hook's directory is left off
    PYTHONPATH and the rank's metric files are not named, so that such a process neither
    loads the runtime hook nor writes into a rank's records."""
    hook = "/".join(RUNTIME_HOOK_DIR)
    parts = [p for p in env.get("PYTHONPATH", "").split(":") if p and not p.endswith(hook)]
    out = {k: v for k, v in env.items()
           if k not in ("PYTHONPATH", METRICS_FILE_ENV, METRICS_CONFIG_ENV)}
    if parts:
        out["PYTHONPATH"] = ":".join(parts)
    return out


@dataclass(frozen=True)
class WandbSettings:
    """Where a cluster's W&B run goes (spec: metrics.wandb)."""

    project: str
    mode: str
    """"online" or "offline"."""
    entity: str | None
    name: str
    """The run's name (the cluster's)."""
    group: str
    """The runs' group (the job id): one W&B group per job, one run per cluster."""
    dir: str
    """Absolute path on the host under which W&B keeps its files (in dir/wandb)."""


@dataclass(frozen=True)
class MetricsConfig:
    """`metrics.json`: the optional metrics sinks of the process that writes its cluster's runs
    (spec: metrics); read by `nebula_cli.runtime.sinks`. metrics.jsonl is always written."""

    job_id: str
    cluster: str
    tensorboard_dir: str | None
    """Absolute path on the host of the cluster's TensorBoard run; None: no TensorBoard."""
    wandb: WandbSettings | None
    """None: no W&B."""

    @classmethod
    def load(cls, path: str | Path) -> MetricsConfig:
        return strict.load(cls, path)
