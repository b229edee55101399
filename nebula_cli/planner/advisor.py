"""The sync advisor: how many inner steps H and which codec make the WAN time of an outer round
hide behind compute (DiLoCo mode: data parallel across clusters through the relays).

Model, for P trainable parameters, one inner step of t seconds, a WAN link of B Mbit/s and an
rtt of R seconds between n clusters:

- bytes one cluster sends per round: ``P * bytes_per_param``, what the codec says it costs
  (`CodecParams.bytes_per_element` in `nebula_cli.config.codec_params`): none 4, fp16 2, bf16 2,
  int8 1 + 4/256 (one float32 scale per block of 256), topk about 0.051 at its defaults (1 of
  16 values, 2 bits each, a 4-bit position, two bfloat16 scales per 1024);
- WAN time of a round: ``T = f(n) * bytes * 8 / (B * 1e6) + 3 * R`` where f(2) = 1 (the two
  relays send their update to each other at the same time: one rtt for the exchange, about two
  for the round's agreement) and f(n) = 2 (n - 1) / n for n >= 3 (shard owners: reduce-scatter
  then all-gather, 3 rtt in all), or f(n) = n - 1 for a sparse codec (topk: every relay sends
  its encoding to each other one); T = 0 for one cluster;
- compute a round hides behind: ``C = H * t``;
- utilisation without overlap ``C / (C + T)``; with overlap (the round runs during the next H
  steps) ``min(1, C / T)``.

The recommendation is the smallest H of the grid at which some codec reaches the target, and at
that H the most accurate such codec (by the codecs' relative error bounds, `rel_error`: none,
then fp16 — 11 significant bits —, then bf16 — 8 —, then int8 — blockwise absmax / 254 —, then
topk, which drops most values; topk is compared when asked for, not by default). If nothing
reaches the target, the best utilisation the grid offers, marked as not reached. `needed_h`
gives, per codec, the exact smallest H that reaches the target (not restricted to the grid).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nebula_cli.config.codec_params import CODEC_PARAMS, CodecParams
from nebula_cli.planner.costmodel import PlanError

ACCURACY_ORDER = tuple(sorted(CODEC_PARAMS, key=lambda name: CODEC_PARAMS[name].rel_error))
"""Most accurate first (the codecs' relative error bounds)."""
DEFAULT_CODECS = ("none", "bf16", "fp16", "int8")
"""The codecs compared unless asked for others."""
DEFAULT_H = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
ROUND_RTTS = 3
"""Round-trip times a round costs besides the transfer."""


@dataclass(frozen=True)
class Prediction:
    """One (codec, H) point: bytes a cluster sends per round, WAN time, compute time, and the
    utilisation without and with overlap."""

    codec: str
    inner_steps: int
    bytes_per_round: float
    wan_s: float
    compute_s: float
    utilisation_sequential: float
    utilisation_overlap: float

    def utilisation(self, overlap: bool) -> float:
        return self.utilisation_overlap if overlap else self.utilisation_sequential


@dataclass(frozen=True)
class Advice:
    """Every prediction and the recommendation for one set of inputs."""

    params: int
    step_time_s: float
    bandwidth_mbit: float
    rtt_ms: float
    clusters: int
    overlap: bool
    target: float
    predictions: list[Prediction]
    recommended: Prediction
    reached: bool
    """Whether the recommendation reaches the target."""
    needed_h: dict[str, int | None] = field(default_factory=dict)
    """Per codec, the smallest H reaching the target (None: no H does)."""

    @property
    def utilisation(self) -> float:
        return self.recommended.utilisation(self.overlap)

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: inputs, every prediction, the recommendation, the spec lines."""
        data = asdict(self)
        data["recommended"] = asdict(self.recommended)
        data["spec_lines"] = spec_lines(self)
        return data


def wan_seconds(update_bytes: float, bandwidth_mbit: float, rtt_ms: float, clusters: int, *,
                sparse: bool = False) -> float:
    """WAN time of one outer round (see the module docstring); ``sparse``: the codec's
    encodings go to every other relay, never re-encoded."""
    if clusters <= 1:
        return 0.0
    share = (clusters - 1 if sparse else 1.0 if clusters == 2
             else 2 * (clusters - 1) / clusters)
    return share * update_bytes * 8 / (bandwidth_mbit * 1e6) + ROUND_RTTS * rtt_ms / 1e3


def codec_cost(codec: str, codec_params: CodecParams | None = None) -> CodecParams:
    """The params the advisor prices ``codec`` with: ``codec_params`` (its knobs, e.g. topk's
    density), else the codec's defaults. PlanError for a codec that is not one, or params of
    another codec."""
    cls = CODEC_PARAMS.get(codec)
    if cls is None:
        raise PlanError(f"unknown codec {codec!r}; known: {', '.join(ACCURACY_ORDER)}")
    if codec_params is None:
        return cls()
    if not isinstance(codec_params, cls):
        raise PlanError(f"params {codec_params!r} are not those of codec {codec}")
    return codec_params


def predict(codec: str, h: int, *, params: int, step_time_s: float, bandwidth_mbit: float,
            rtt_ms: float, clusters: int, codec_params: CodecParams | None = None
            ) -> Prediction:
    """One (codec, H) prediction (``codec_params``: the codec's knobs; default: its
    defaults)."""
    cost = codec_cost(codec, codec_params)
    nbytes = params * cost.bytes_per_element()
    wan = wan_seconds(nbytes, bandwidth_mbit, rtt_ms, clusters, sparse=cost.sparse)
    compute = h * step_time_s
    sequential = compute / (compute + wan)
    overlap = 1.0 if wan == 0 else min(1.0, compute / wan)
    return Prediction(codec, h, nbytes, wan, compute, sequential, overlap)


def advise(params: int, step_time_s: float, bandwidth_mbit: float, rtt_ms: float, *,
           clusters: int = 2, codecs: Sequence[str] = DEFAULT_CODECS,
           h_values: Sequence[int] = DEFAULT_H, overlap: bool = False,
           target: float = 0.95) -> Advice:
    """Predict every (codec, H) and recommend the smallest H, then the most accurate codec,
    that reach `target` utilisation."""
    _check(params, step_time_s, bandwidth_mbit, rtt_ms, clusters, codecs, h_values, target)
    common = dict(params=params, step_time_s=step_time_s, bandwidth_mbit=bandwidth_mbit,
                  rtt_ms=rtt_ms, clusters=clusters)
    hs = sorted(set(int(h) for h in h_values))
    preds = [predict(c, h, **common) for c in codecs for h in hs]
    rank = {c: i for i, c in enumerate(ACCURACY_ORDER)}
    good = [p for p in preds if p.utilisation(overlap) >= target]
    if good:
        best = min(good, key=lambda p: (p.inner_steps, rank[p.codec]))
    else:
        best = max(preds, key=lambda p: (p.utilisation(overlap), -p.inner_steps,
                                          -rank[p.codec]))
    needed = {c: _needed_h(c, overlap, target, **common) for c in codecs}
    return Advice(params, step_time_s, bandwidth_mbit, rtt_ms, clusters, overlap, target,
                  preds, best, bool(good), needed)


def _needed_h(codec: str, overlap: bool, target: float, *, params: int, step_time_s: float,
              bandwidth_mbit: float, rtt_ms: float, clusters: int) -> int | None:
    cost = codec_cost(codec)
    wan = wan_seconds(params * cost.bytes_per_element(), bandwidth_mbit, rtt_ms, clusters,
                      sparse=cost.sparse)
    if wan == 0:
        return 1
    if overlap:
        h = target * wan / step_time_s
    elif target >= 1:
        return None
    else:
        h = target * wan / ((1 - target) * step_time_s)
    h = max(1, math.ceil(h - 1e-9))
    # guard the rounding: step up until the prediction agrees
    while predict(codec, h, params=params, step_time_s=step_time_s,
                  bandwidth_mbit=bandwidth_mbit, rtt_ms=rtt_ms,
                  clusters=clusters).utilisation(overlap) < target:
        h += 1
    return h


def _check(params: int, step_time_s: float, bandwidth_mbit: float, rtt_ms: float,
           clusters: int, codecs: Sequence[str], h_values: Sequence[int], target: float) -> None:
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise PlanError(f"params must be a whole number >= 1, found {params!r}")
    checks = ((step_time_s, "step time (s)", False),
              (bandwidth_mbit, "bandwidth (Mbit/s)", False), (rtt_ms, "rtt (ms)", True))
    for value, name, zero_ok in checks:
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise PlanError(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, "
                            f"found {value}")
    if clusters < 1:
        raise PlanError(f"clusters must be >= 1, found {clusters}")
    unknown = [c for c in codecs if c not in CODEC_PARAMS]
    if unknown or not codecs:
        raise PlanError(f"unknown codec(s) {', '.join(unknown) or '(none given)'}; known: "
                        f"{', '.join(ACCURACY_ORDER)}")
    if not h_values or any(int(h) != h or h < 1 for h in h_values):
        raise PlanError(f"inner step counts must be whole numbers >= 1, found {list(h_values)}")
    if not 0 < target <= 1:
        raise PlanError(f"target utilisation must be in (0, 1], found {target}")


def spec_lines(advice: Advice) -> str:
    """The job-spec YAML that applies the recommendation."""
    rec = advice.recommended
    lines = ["relay:", "  sync:", "    mode: diloco", f"    inner_steps: {rec.inner_steps}"]
    if advice.overlap:
        lines.append("    overlap: true")
    lines += ["  compression:", f"    codec: {rec.codec}"]
    return "\n".join(lines) + "\n"
