"""RelayConfig: the relay's part of the job plan (relay.json, written at launch, 0600)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.config import strict
from nebula_cli.config.codec_params import AUTO_CODEC, CodecParamSet
from nebula_cli.errors import NebulaError


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
    """cluster -> host:port of its peer_listen, for every other cluster, or the absolute path
    of the Unix socket that is the local end of this relay's SSH tunnel to it."""
    tls: TlsFiles
    codec: str
    """Codec of the WAN hop (a name of `codec_params.CODEC_PARAMS`), or "auto" (see
    auto_codec)."""
    error_feedback: bool
    """Keep the codec's rounding error and add it to the next round's contribution."""
    feedback_decay: dict[str, float]
    """Codec -> the decay of the kept error when a round that uses it takes the error in
    (`CompressionSpec.decay_for`; with ``compression: auto`` the codec of the round being
    encoded decides); a codec the rounds may use and this omits decays by its own default."""
    codec_params: CodecParamSet
    """Every codec's knobs (codec name -> its params), from the spec: the rounds build their
    codecs from them, the HELLO carries them all (`CodecParamSet.handshake`)."""
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
    to a multiple of `block_size`."""
    auto_codec: AutoCodec | None = None
    """Set with ``compression: auto`` (then ``codec`` is "auto"): how the coordinator chooses
    each round's codec; None: every round uses ``codec``."""
    worker_socket: str | None = None
    """Unix socket (in the relay's private directory) where workers on the relay's own host
    connect without TLS (peer uid checked, tensors in sealed shared memory:
    `nebula_cli.relay.net.local_socket`); None: the TLS port only."""

    def __post_init__(self) -> None:
        for name, part in (("tls", TlsFiles), ("shaping", ShapingConfig),
                           ("auto_steps", AutoSteps), ("auto_codec", AutoCodec)):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, _part(part, getattr(self, name), name))
        if not isinstance(self.codec_params, CodecParamSet):  # from_dict loaded it already
            try:
                self.codec_params = CodecParamSet.from_plan(self.codec_params, "codec_params")
            except strict.PlanFileError as exc:
                raise RelayConfigError(str(exc)) from exc
        self.validate()

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise RelayConfigError unless the fields agree with each other. Types and the ranges
        the spec holds its fields to are not checked again: `from_dict` loads every field of
        its type (`config.strict`), and codec knobs are checked by their codec
        (`CodecParamSet.from_plan`)."""
        if len(set(self.clusters)) != len(self.clusters):
            raise RelayConfigError(f"clusters: a cluster is listed twice: {self.clusters}")
        if self.cluster not in self.clusters:
            raise RelayConfigError(f"cluster {self.cluster!r} is not in clusters {self.clusters}")
        expected = set(self.clusters) - {self.cluster}
        if set(self.peers) != expected:
            raise RelayConfigError(
                f"peers: expected an address for each of {sorted(expected)}, "
                f"got {sorted(self.peers)}"
            )
        for addr in [self.peer_listen, self.worker_listen,
                     *(a for a in self.peers.values() if not os.path.isabs(a))]:
            parse_addr(addr)
        if self.worker_socket is not None and not os.path.isabs(self.worker_socket):
            raise RelayConfigError(
                f"worker_socket: expected an absolute path or null, got {self.worker_socket!r}")
        if self.chunk_numel <= 0:
            raise RelayConfigError(
                f"chunk_numel: expected a positive integer, got {self.chunk_numel!r}")
        if (self.codec == AUTO_CODEC) != (self.auto_codec is not None):
            raise RelayConfigError(f"codec {self.codec!r} and auto_codec {self.auto_codec!r}: "
                                   f"auto_codec is set exactly when codec is {AUTO_CODEC!r}")
        rounds = self.auto_codec.codecs if self.auto_codec is not None else [self.codec]
        for codec, beta in self.feedback_decay.items():
            if codec not in rounds:
                raise RelayConfigError(f"feedback_decay: {codec!r} is not a codec the rounds "
                                       f"use ({', '.join(rounds)})")
            if not 0.0 < beta <= 1.0:
                raise RelayConfigError(f"feedback_decay.{codec}: expected a number in (0, 1], "
                                       f"found {beta!r}")

    # ------------------------------------------------------------------ derived

    @property
    def dials(self) -> list[str]:
        """Peers this relay dials: the clusters listed before it (one connection per pair)."""
        return self.clusters[: self.clusters.index(self.cluster)]

    @property
    def block_size(self) -> int:
        """The relays cut every tensor into chunks of whole int8 blocks, whatever the codec (so
        that ``compression: auto`` switches codecs on the same chunk boundaries)."""
        return cast(Int8Params, self.codec_params[Int8Params.name]).block_size

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
        try:
            cfg = cls.from_dict(data)
        except RelayConfigError as exc:
            raise RelayConfigError(f"{path}: {exc}") from exc
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


def _part(cls: type, data: Any, what: str) -> Any:
    """`strict.from_dict`, its refusal as a RelayConfigError."""
    try:
        return strict.from_dict(cls, data, what)
    except strict.PlanFileError as exc:
        raise RelayConfigError(str(exc)) from exc
