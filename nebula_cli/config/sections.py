"""The spec's sections other than clusters and hosts: relay (sync, compression, shaping),
checkpoint and parallelism, and `SpecModel`, the strict base of every spec model.

Re-exported by `nebula_cli.config.spec`; each field's default is defined here, once, except the
codecs' knobs and outer-step defaults: each codec declares its own (`codec_params`), and
`CompressionSpec` has a field per knob made from that declaration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from nebula_cli.config.codec_params import (
    AUTO_CODEC,
    AUTO_CODECS,
    CODEC_PARAMS,
    CodecParams,
    CodecParamSet,
    knob_owner,
    params_from_knobs,
)
from nebula_cli.config.fields import Duration, Port, StepsOrAuto
from nebula_cli.config.rotation import Rotation
from nebula_cli.config.yaml_positions import problems_error


class SpecModel(BaseModel):
    """Base of every spec model: unknown keys refused, no type coercion, finite numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class SyncSpec(SpecModel):
    """How clusters combine their work over the WAN."""

    mode: Literal["diloco", "gradient"] = "diloco"
    """'diloco': average parameter deltas every inner_steps; 'gradient': every step."""
    inner_steps: StepsOrAuto = 100
    """Local steps between outer syncs (diloco). ``auto``: the relays choose them round by round
    from the measured step and round times, to keep the share of time spent training at
    target_utilization while syncing as often as that allows (all clusters use the same H)."""
    every: Duration | None = None
    """Time-based rounds (diloco), e.g. ``60s``: each cluster trains this long between rounds,
    as many steps as it can, and the average is weighted by the samples each cluster processed
    (a slower cluster never makes a faster one wait). Default: rounds by inner_steps."""
    target_utilization: float = Field(0.95, gt=0.0, lt=1.0)
    """inner_steps: auto: the share of wall time spent training that H is chosen for."""
    min_inner_steps: int = Field(5, ge=1)
    """inner_steps: auto: the smallest H, and the first round's."""
    max_inner_steps: int = Field(1000, ge=1)
    """inner_steps: auto: the largest H."""
    outer_lr: float | None = Field(None, gt=0.0)
    """Outer optimizer learning rate (diloco). Default: the codec's (`CodecParams.outer_lr`:
    0.6, and 2.5 for topk)."""
    outer_momentum: float | None = Field(None, ge=0.0, lt=1.0)
    """Outer SGD momentum in [0, 1) (diloco). Default: the codec's (0.5, and 0 for topk, whose
    error feedback already carries the past rounds, as in SparseLoCo)."""
    nesterov: bool = True
    """Nesterov momentum for the outer step."""
    overlap: bool = False
    """Overlap the outer sync with the next inner steps (the average is applied a few steps
    after the round started, on top of the progress made meanwhile)."""
    overlap_steps: int | None = Field(None, ge=1)
    """Overlap: apply the average exactly this many inner steps after the round starts (waiting
    for it if needed; >= inner_steps: one round late). Default: the relays agree it from the
    last rounds' times (the round in the fastest cluster's steps, plus half a step), the same
    on every cluster; 1 for the first two rounds."""

    @model_validator(mode="after")
    def _one_cadence(self) -> SyncSpec:
        given = self.model_fields_set
        problems: list[tuple[tuple[str, ...], str]] = []
        if self.every is not None and "inner_steps" in given:
            problems.append((("every",), "every (time-based rounds) and inner_steps exclude "
                             "each other: remove one"))
        if self.mode == "gradient" and (self.every is not None or self.inner_steps == "auto"):
            field = "every" if self.every is not None else "inner_steps"
            problems.append(((field,), "gradient mode syncs every step; this applies to "
                             "diloco only"))
        if self.min_inner_steps > self.max_inner_steps:
            problems.append((("min_inner_steps",), f"min_inner_steps ({self.min_inner_steps}) "
                             f"is above max_inner_steps ({self.max_inner_steps})"))
        if problems:
            raise problems_error(problems)
        return self

    @property
    def auto(self) -> bool:
        """inner_steps: auto."""
        return self.inner_steps == "auto"

    @property
    def first_inner_steps(self) -> int:
        """H of the first round: inner_steps, or min_inner_steps with auto."""
        return self.min_inner_steps if self.inner_steps == "auto" else self.inner_steps


CodecName = Literal[(*CODEC_PARAMS, AUTO_CODEC)]  # type: ignore[valid-type]


class _Compression(SpecModel):
    """CompressionSpec's fields other than the codecs' knobs, and its checks."""

    codec: CodecName = "int8"
    """Wire codec: none (fp32), fp16, bf16, int8 (blockwise), topk (sparse, low-bit values), or
    auto: the relays choose each round's codec among int8 and topk from the measured round and
    step times (the most faithful that lets the clusters sync as often as the utilisation
    target allows; the first rounds use int8), and say why in their log and the metrics."""
    error_feedback: bool = True
    """Carry the quantisation error into the next round."""
    feedback_decay: float | None = Field(None, gt=0.0, le=1.0)
    """The error feedback's decay beta: what a round left unsent enters the next round's input
    times beta (1: all of it, however many rounds it waits). Default: the codec's
    (`CodecParams.feedback_decay`)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"codec": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _knobs_of_the_codec(self) -> _Compression:
        """A knob set away from its default belongs to a codec the rounds may use."""
        messages = []
        for owner, params in CODEC_PARAMS.items():
            stray = [f.name for f in params.knobs() if f.metadata["only_this_codec"]
                     and getattr(self, f.name) != f.default]
            if stray and owner not in self.codecs:
                verb = "apply" if len(stray) > 1 else "applies"
                auto = " (or auto)" if owner in AUTO_CODECS else ""
                messages.append(f"{' and '.join(stray)} {verb} to codec {owner}{auto} only, "
                                f"not {self.codec} (set codec: {owner}, or remove them)")
        if self.feedback_decay is not None and not self.error_feedback:
            messages.append("feedback_decay applies to error feedback, which is off "
                            "(set error_feedback: true, or remove feedback_decay)")
        if messages:
            raise ValueError("; ".join(messages))
        return self

    def decay_for(self, codec: str) -> float:
        """The error feedback's decay of a round that uses ``codec``: the spec's, else the
        codec's."""
        given = self.feedback_decay
        return CODEC_PARAMS[codec].feedback_decay if given is None else given

    @property
    def decays(self) -> dict[str, float]:
        """Codec -> its rounds' decay, for each codec a round may use (the relay plan's map)."""
        return {c: self.decay_for(c) for c in self.codecs}

    @property
    def codecs(self) -> tuple[str, ...]:
        """The codecs a round may use: the codec, or auto's candidates (most faithful first)."""
        return AUTO_CODECS if self.codec == AUTO_CODEC else (self.codec,)

    @property
    def params(self) -> CodecParamSet:
        """Every codec's params, from this section's knobs."""
        return params_from_knobs({name: getattr(self, name) for name in knob_owner()})


def _knob_field(params: type[CodecParams], knob: dataclasses.Field[Any]) -> tuple[Any, Any]:
    """The spec field of a codec's knob: its type (one of its choices, when it has them), its
    default and its bounds, as the codec declares them."""
    choices = knob.metadata["choices"]
    kind = Literal[choices] if choices else params.knob_types()[knob.name]
    return kind, Field(knob.default, **knob.metadata["limits"])


CompressionSpec = create_model(
    "CompressionSpec", __base__=_Compression, __module__=__name__,
    __doc__="""How tensors are encoded on the WAN; also written as a codec name (``compression:
    int8``). The default, int8, loses at most 3 % of eval loss against flat data parallel at every
    run length bench/diloco_schedule.py covers (2, 5 and 20 rounds); topk sends about 20x fewer
    bytes, within 1 % at 30 rounds but about 2 % behind at 5 and 20 % at 2 (what it leaves out
    of the last rounds is never sent): docs/benchmarks.md, "A default safe at every length" and
    "Error feedback as momentum". Besides ``codec``, ``error_feedback`` and ``feedback_decay``,
    one field per codec knob, flat (``block_size`` of int8, ``density``, ``bits`` and ``span``
    of topk: see
    `nebula_cli.config.codec_params`); a knob of a codec the rounds do not use is refused
    unless left at its default.""",
    **{knob.name: _knob_field(params, knob)
       for params in CODEC_PARAMS.values() for knob in params.knobs()})


class ShapingSpec(SpecModel):
    """WAN emulation on the relay's peer links, for local runs and demos."""

    rate_mbit: float | None = Field(None, gt=0.0)
    """Bandwidth cap in Mbit/s. Default: none."""
    delay_ms: float = Field(0.0, ge=0.0)
    """One-way delay added to every peer message, in ms."""


class RelaySpec(SpecModel):
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
    heartbeat: float = Field(2.0, gt=0.0)
    """Seconds between liveness messages on peer links."""
    dead_after: float = Field(10.0, gt=0.0)
    """Seconds of silence after which a peer relay is taken for dead (its link is closed and
    rounds go on without it). At least two heartbeats."""
    shaping: ShapingSpec | None = None
    """WAN emulation. Default: none."""

    @model_validator(mode="after")
    def _outer_defaults(self) -> RelaySpec:
        """Fill the outer settings in from the codec (with ``compression: auto`` those not
        given stay unset: each round takes its codec's, see outer_for)."""
        if len(self.compression.codecs) == 1:
            self.sync.outer_lr, self.sync.outer_momentum = self.outer_for(
                self.compression.codec)
        return self

    def outer_for(self, codec: str) -> tuple[float, float]:
        """Outer lr and momentum of a round that uses ``codec``: the spec's, else the codec's
        (`CodecParams.outer_lr`, `outer_momentum`)."""
        params = CODEC_PARAMS[codec]
        lr, momentum = params.outer_lr, params.outer_momentum
        given_lr, given_momentum = self.sync.outer_lr, self.sync.outer_momentum
        return (lr if given_lr is None else given_lr,
                momentum if given_momentum is None else given_momentum)

    @model_validator(mode="after")
    def _check_ports(self) -> RelaySpec:
        if self.worker_port == self.port:
            message = f"worker_port must differ from port (both are {self.port})"
            raise problems_error([(("worker_port",), message)])
        if self.dead_after < 2 * self.heartbeat:
            message = (f"dead_after ({self.dead_after:g} s) must allow at least two heartbeats "
                       f"({2 * self.heartbeat:g} s)")
            raise problems_error([(("dead_after",), message)])
        if self.worker_port is None and self.port == 65535:
            message = "port 65535 leaves no room for the default worker_port (port + 1)"
            raise problems_error([(("port",), message)])
        return self

    @property
    def effective_worker_port(self) -> int:
        """The port workers dial to reach their relay."""
        return self.worker_port or self.port + 1


class CheckpointSpec(SpecModel):
    """Where and how often workers checkpoint."""

    dir: str = "checkpoints"
    """Directory relative to the job dir on each host."""
    every: int | None = Field(None, ge=1)
    """Steps between checkpoints. Default: only at stop."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept."""


class ParallelismSpec(SpecModel):
    """How one model is split over the clusters' devices."""

    pipeline_stages: int = Field(1, ge=1)
    """Pipeline stages (DeepSpeed PipelineModule) over every slot of every cluster, in one
    DeepSpeed world spanning the clusters (no relay). 1: no pipeline (data parallel)."""
    cleartext_wan: bool = False
    """Accept that a pipeline across clusters sends activations and gradients over the WAN
    unencrypted (the relay's TLS does not carry them). Required for such a pipeline."""


class WandbSpec(SpecModel):
    """Weights & Biases: one run per cluster (named after it, grouped by the job id), written by
    the cluster's first rank. Needs `wandb` on the hosts (`pip install 'nebula-cli[wandb]'`);
    without it the worker says so once in its log and trains on."""

    project: str = Field(min_length=1, max_length=128)
    """The W&B project the runs go to."""
    mode: Literal["online", "offline"] = "online"
    """'online': sent to W&B as training goes (the hosts need its API key, e.g. WANDB_API_KEY
    in the spec's `env`); 'offline': kept in the job directory on the host, for `wandb sync`."""
    entity: str | None = Field(None, min_length=1, max_length=128)
    """The W&B team or user. Default: the API key's own."""


class MetricsSpec(SpecModel):
    """Where the workers' metrics go besides `metrics.jsonl` (always written): each cluster's
    first rank (rank 0 of its DeepSpeed world) writes the cluster's run."""

    tensorboard: bool = False
    """Write TensorBoard event files per cluster in the job directory on the hosts (`nebula
    report` and `nebula logs` fetch them to $NEBULA_HOME/jobs/<id>/tb). Needs `tensorboard` on
    the hosts (`pip install 'nebula-cli[tb]'`)."""
    wandb: WandbSpec | None = None
    """Log to Weights & Biases. Default: none."""


class LogsSpec(SpecModel):
    """How big the files a job keeps growing on its hosts may get: each process's log
    (``logs/rank0.log``, ``logs/relay.log``), its metrics records (``metrics/rank0.jsonl``), its
    agent's log and events. Each file is rotated (`config.rotation`): the live file plus at
    most `keep` older ones, so a month-long run holds at most ``(keep + 1) * max_mb`` per file.
    `nebula logs`, `status`, the live view and `report` read across the rotated files."""

    max_mb: float = Field(64.0, gt=0, le=1 << 20)
    """Size at which a file is rotated, in MiB. Default: 64."""
    keep: int = Field(3, ge=0, le=100)
    """Rotated files kept per file (older ones are removed). Default: 3."""

    def rotation(self) -> Rotation:
        return Rotation(max_bytes=int(self.max_mb * (1 << 20)), keep=self.keep)
