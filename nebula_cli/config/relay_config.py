"""RelayConfig: the relay's part of the job plan (relay.json, written at launch, 0600)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_cli.config import strict
from nebula_cli.errors import NebulaError

TOPK_DENSITY = 0.0625
"""Default fraction of elements the topk codec keeps (1 of every 16)."""
TOPK_BITS = 2
"""Default bits per value the topk codec keeps."""
TOPK_BIT_CHOICES = (2, 4, 8)
AUTO_CODEC = "auto"
"""The spec's ``compression: auto``: the relays choose each round's codec among AUTO_CODECS."""
AUTO_CODECS = ("int8", "topk")
"""The codecs ``compression: auto`` chooses from, the most faithful first (the first rounds')."""


class RelayConfigError(NebulaError):
    """A relay.json that cannot be used (unknown key, wrong type, inconsistent clusters)."""


def parse_addr(addr: str) -> tuple[str, int]:
    """"host:port" (or "[v6]:port") -> (host, port); RelayConfigError if malformed."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise RelayConfigError(f"address {addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


@dataclass
class TlsFiles:
    """This relay's PEM files: the job CA, its certificate and its private key."""

    ca: str
    cert: str
    key: str


@dataclass
class ShapingConfig:
    """WAN emulation on outgoing peer traffic (local runs, demos, benchmarks); off by default."""

    rate_mbit: float | None
    """Outgoing rate per peer link in Mbit/s (token bucket); None = unlimited."""
    delay_ms: float
    """One-way delay added in user space to every frame sent to a peer."""


@dataclass(frozen=True)
class AutoSteps:
    """``relay.sync.inner_steps: auto``: the round's coordinator picks H for the next round from
    the clusters' measured step and round times (`nebula_cli.relay.protocol.pacing`)."""

    target_utilization: float
    """Fraction of wall time spent training that H is chosen to reach."""
    min_steps: int
    """The smallest H (also the first round's)."""
    max_steps: int
    """The largest H."""
    overlap: bool
    """Rounds overlap the next inner steps: H only has to cover the round's time."""


@dataclass(frozen=True)
class AutoCodec:
    """``relay.compression: auto``: the round's coordinator picks the codec of the next round
    from the clusters' measured step and round times (`nebula_cli.relay.codecs.choice`)."""

    codecs: list[str]
    """The codecs to choose from, the most faithful (and largest) first; the first rounds'."""
    target_utilization: float
    """Fraction of wall time spent training that the codec (and H) are chosen to reach."""
    overlap: bool
    """Rounds overlap the next inner steps (the round only has to fit behind them)."""
    budget_steps: int | None
    """A fixed H: the codec is chosen to fit behind that many steps (None: ``inner_steps:
    auto`` chooses H with the codec, or time-based rounds)."""
    budget_s: float | None
    """Time-based rounds (``sync.every``): the codec is chosen to fit behind that many
    seconds."""


@dataclass
class RelayConfig:
    """One relay's configuration; `load`/`dump` read and write relay.json (unknown keys refused).
    Every setting the spec has comes from the spec (its defaults are defined there only)."""

    job_id: str
    cluster: str
    """This relay's cluster."""
    clusters: list[str]
    """All clusters of the job, in `JobSpec.dial_order` (those that accept connections first,
    then spec order). A cluster dials every cluster listed before it."""
    peer_listen: str
    """host:port where relays of later clusters dial this relay (the WAN side)."""
    worker_listen: str
    """host:port where this cluster's workers (RelayClient) connect with mutual TLS."""
    peers: dict[str, str]
    """cluster -> host:port of its peer_listen, for every other cluster."""
    tls: TlsFiles
    codec: str
    """Codec of the WAN hop (none, fp16, bf16, int8, topk), or "auto" (see auto_codec)."""
    error_feedback: bool
    """Keep the codec's rounding error and add it to the next round's contribution."""
    block_size: int
    """Block of the int8 codec (one absmax scale per block)."""
    round_timeout: float
    """Seconds from the arrival of the local contribution until the round goes ahead without
    the clusters not ready by then."""
    heartbeat: float
    """Seconds between heartbeats on an idle peer link."""
    dead_after: float
    """Seconds of silence after which a peer link is closed (the peer taken for dead)."""
    shaping: ShapingConfig
    auto_steps: AutoSteps | None
    """Set with ``inner_steps: auto``: how the coordinator chooses H; None: fixed H."""
    status_file: str | None = None
    """JSON status rewritten (atomic rename) after each round and on peer changes."""
    metrics_file: str | None = None
    """JSON lines, one per round."""
    chunk_numel: int = 1 << 20
    """Elements per chunk: the unit that is encoded, sent and decoded (pipelined); rounded down
    to a multiple of block_size."""
    density: float = TOPK_DENSITY
    """topk: fraction of the elements kept per block of 256."""
    bits: int = TOPK_BITS
    """topk: bits per kept value (2, 4 or 8)."""
    auto_codec: AutoCodec | None = None
    """Set with ``compression: auto`` (then ``codec`` is "auto"): how the coordinator chooses
    each round's codec; None: every round uses ``codec``."""
    worker_socket: str | None = None
    """Unix socket (in the relay's private directory) where workers on the relay's own host
    connect without TLS (peer uid checked, tensors in sealed shared memory:
    `nebula_cli.relay.net.local_socket`); None: the TLS port only."""

    def __post_init__(self) -> None:
        if isinstance(self.tls, dict):
            self.tls = _part(TlsFiles, self.tls, "tls")
        if isinstance(self.shaping, dict):
            self.shaping = _part(ShapingConfig, self.shaping, "shaping")
        if isinstance(self.auto_steps, dict):
            self.auto_steps = _part(AutoSteps, self.auto_steps, "auto_steps")
        if isinstance(self.auto_codec, dict):
            self.auto_codec = _part(AutoCodec, self.auto_codec, "auto_codec")
        self.validate()

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise RelayConfigError on anything inconsistent."""
        _type("job_id", self.job_id, str)
        _type("cluster", self.cluster, str)
        if not isinstance(self.clusters, list) or not all(isinstance(c, str)
                                                          for c in self.clusters):
            raise RelayConfigError("clusters: expected a list of cluster names")
        if len(set(self.clusters)) != len(self.clusters):
            raise RelayConfigError(f"clusters: a cluster is listed twice: {self.clusters}")
        if self.cluster not in self.clusters:
            raise RelayConfigError(f"cluster {self.cluster!r} is not in clusters {self.clusters}")
        if not isinstance(self.peers, dict):
            raise RelayConfigError("peers: expected a mapping cluster -> host:port")
        expected = set(self.clusters) - {self.cluster}
        if set(self.peers) != expected:
            raise RelayConfigError(
                f"peers: expected an address for each of {sorted(expected)}, "
                f"got {sorted(self.peers)}"
            )
        for addr in [self.peer_listen, self.worker_listen, *self.peers.values()]:
            parse_addr(addr)
        if self.worker_socket is not None and not (isinstance(self.worker_socket, str)
                                                   and os.path.isabs(self.worker_socket)):
            raise RelayConfigError(
                f"worker_socket: expected an absolute path or null, got {self.worker_socket!r}")
        for name in ("round_timeout", "heartbeat", "dead_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise RelayConfigError(
                    f"{name}: expected a positive number of seconds, got {value!r}")
        for name in ("block_size", "chunk_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RelayConfigError(f"{name}: expected a positive integer, got {value!r}")
        _type("codec", self.codec, str)
        _type("error_feedback", self.error_feedback, bool)
        density = self.density
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not (
                0 < density <= 1):
            raise RelayConfigError(f"density: expected a number in (0, 1], got {density!r}")
        choice = self.auto_codec
        if (self.codec == AUTO_CODEC) != (choice is not None):
            raise RelayConfigError(f"codec {self.codec!r} and auto_codec {choice!r}: auto_codec "
                                   f"is set exactly when codec is {AUTO_CODEC!r}")
        if choice is not None and not (choice.codecs and 0 < choice.target_utilization < 1):
            raise RelayConfigError(f"auto_codec: expected codecs to choose from and 0 < "
                                   f"target_utilization < 1, got {choice!r}")
        if isinstance(self.bits, bool) or self.bits not in TOPK_BIT_CHOICES:
            raise RelayConfigError(f"bits: expected one of {TOPK_BIT_CHOICES}, got {self.bits!r}")
        rate = self.shaping.rate_mbit
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or rate <= 0):
            raise RelayConfigError(
                f"shaping.rate_mbit: expected a positive number or null, got {rate!r}")
        delay = self.shaping.delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise RelayConfigError(f"shaping.delay_ms: expected a number >= 0, got {delay!r}")
        auto = self.auto_steps
        if auto is not None and not (0 < auto.target_utilization < 1
                                     and 1 <= auto.min_steps <= auto.max_steps):
            raise RelayConfigError(f"auto_steps: expected 0 < target_utilization < 1 and "
                                   f"1 <= min_steps <= max_steps, got {auto!r}")

    # ------------------------------------------------------------------ derived

    @property
    def dials(self) -> list[str]:
        """Peers this relay dials: the clusters listed before it (one connection per pair)."""
        return self.clusters[: self.clusters.index(self.cluster)]

    @property
    def accepts(self) -> list[str]:
        """Peers that dial this relay: the clusters listed after it."""
        return self.clusters[self.clusters.index(self.cluster) + 1 :]

    # ------------------------------------------------------------------ files

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RelayConfig:
        """Strictly, as every part of the plan (`config.strict`): every key, of its type."""
        return _part(cls, data, "relay config")

    def to_dict(self) -> dict[str, Any]:
        return strict.to_dict(self)

    @classmethod
    def load(cls, path: str | Path) -> RelayConfig:
        """Read relay.json; relative file paths in it are taken relative to its directory."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise RelayConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise RelayConfigError(f"{path}:{exc.lineno}:{exc.colno}: {exc.msg}") from exc
        if not isinstance(data, dict):
            raise RelayConfigError(f"{path}: expected a JSON object")
        cfg = cls.from_dict(data)
        base = path.resolve().parent
        for holder, name in [(cfg.tls, "ca"), (cfg.tls, "cert"), (cfg.tls, "key"),
                             (cfg, "status_file"), (cfg, "metrics_file")]:
            value = getattr(holder, name)
            if value and not os.path.isabs(value):
                setattr(holder, name, str(base / value))
        return cfg

    def dump(self, path: str | Path) -> None:
        """Write relay.json (atomically, readable by its owner only)."""
        strict.write(self, path)


def _type(name: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise RelayConfigError(f"{name}: expected {kind.__name__}, got {value!r}")


def _part(cls: type, data: Any, what: str) -> Any:
    """`strict.from_dict`, its refusal as a RelayConfigError."""
    try:
        return strict.from_dict(cls, data, what)
    except strict.PlanFileError as exc:
        raise RelayConfigError(str(exc)) from exc
