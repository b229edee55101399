"""How often clusters sync, decided by the relays: what each cluster tells about its round
(:class:`RoundInfo`), the weights of an average, and the next round's H with
``inner_steps: auto`` (:func:`choose_inner_steps`). Pure functions of what the READYs carried.

Each worker's contribution carries a :class:`RoundInfo`: the samples it trained on since its
last round (the weight of its delta in the average: a cluster that did twice the work counts
twice, as Decoupled DiLoCo's token-weighted merge does), its mean seconds per optimizer step
over those steps (compute only), and how long its previous round kept it from training. The
relay forwards it in its READY; the coordinator puts the present clusters' weights and, with
``inner_steps: auto``, the next H into its decision, so every relay averages with the same
weights and every cluster trains the same H next (agreed, not guessed).

Choosing H: let ``t`` be the slowest cluster's step time (with a fixed H every cluster waits for
it) and ``c`` the cheapest cluster's round cost (the cluster that arrived last waited least:
its cost is the round itself, not waiting for others). Without overlap the share of time spent
training is ``H t / (H t + c)``, so the smallest H that reaches the target ``u`` is
``ceil(u / (1 - u) * c / t)``. With overlap the round runs during the next H steps and costs
nothing once ``H t`` covers it; H is then ``ceil(c / (u t))`` (a margin of 1/u). The result is
clamped to [min_steps, max_steps]; without measurements (the first round) there is no choice and
clusters keep their H.

The merge step with overlap (:func:`choose_merge_steps`): a cluster whose average arrives while
it trains applies it at an agreed step after the boundary, the same on every cluster, rather
than as soon as it arrived there. Merging "when it arrived" let each cluster merge at its own
step: the cluster ahead in steps merged later (it had gone on training while the round waited
for the one behind), so the model each cluster kept differed from run to run, and with it the
loss (bench/wan_training.py at H 10: 1.8-4.1 % against flat from run to run; with the agreed
step 2.6-2.7 % in three runs of three, docs/benchmarks.md). The agreed step is how many of
the fastest cluster's steps the round itself took last time (the cluster that reached the
boundary last waited least: its arrival is the round; counted in the fastest cluster's steps,
no cluster waits for an average still on its way), plus half a step of margin; a cluster whose
average has not arrived by then waits. The step in force stays while the round fits in it
with its margin and at most one step to spare, so that jitter around a step's boundary does
not move it back and forth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from nebula_cli.config.relay_config import AutoSteps
from nebula_cli.relay.net.schema import wire

CODEC_CHARS = 16
"""The longest codec name a READY may carry."""


@dataclass(frozen=True, kw_only=True)
class RoundInfo:
    """What a cluster says about its round (each value None when it did not say). Read
    leniently, from a worker's or a peer's ``info`` object: a value that is not a finite
    number in range is dropped (a missing value only disables what needs it); what is None is
    not sent."""

    LENIENT: ClassVar[bool] = True

    weight: float | None = wire(None, low=0.0, above=True, finite=True, omit_default=True)
    """Samples trained on since the cluster's previous round (> 0)."""
    step_s: float | None = wire(None, low=0.0, above=True, finite=True, omit_default=True)
    """Mean seconds per optimizer step over those steps, training only (> 0)."""
    comm_s: float | None = wire(None, low=0.0, finite=True, omit_default=True)
    """Seconds the cluster's previous round kept it from training (>= 0)."""
    codec: str | None = wire(None, chars=(1, CODEC_CHARS), omit_default=True)
    """The codec of the round ``comm_s`` measured (set by the relay, which knows it; with
    ``compression: auto`` rounds differ)."""
    arrive_s: float | None = wire(None, low=0.0, above=True, finite=True, omit_default=True)
    """Overlap: seconds from the cluster's previous boundary until that round's average
    arrived (> 0)."""


def round_weights(present: list[str] | tuple[str, ...], infos: Mapping[str, RoundInfo]
                  ) -> dict[str, float]:
    """The weights of the present clusters' contributions: their samples when every one of them
    said how many, else none (an equal average)."""
    weights = {c: infos[c].weight for c in present if c in infos}
    if len(weights) != len(present) or any(w is None for w in weights.values()):
        return {}
    return {c: float(w) for c, w in weights.items() if w is not None}


def steps_wanted(cost: float, t: float, u: float, overlap: bool) -> float:
    """Steps of ``t`` seconds that must pass between rounds costing ``cost`` seconds for the
    clusters to spend ``u`` of their time training (see the module's docstring)."""
    return cost / (u * t) if overlap else u / (1.0 - u) * cost / t


def choose_inner_steps(auto: AutoSteps, infos: Mapping[str, RoundInfo]
                       ) -> tuple[int, str] | None:
    """The next round's H and why, from the READYs of this round; None without measurements."""
    steps = [i.step_s for i in infos.values() if i.step_s is not None]
    costs = [i.comm_s for i in infos.values() if i.comm_s is not None]
    if not steps or not costs:
        return None
    t, c, u = max(steps), min(costs), auto.target_utilization
    want = steps_wanted(c, t, u, auto.overlap)
    h = min(auto.max_steps, max(auto.min_steps, math.ceil(want - 1e-9)))
    why = (f"step {t:.3f} s (slowest), round {c:.3f} s (cheapest): "
           f"{'overlapped, ' if auto.overlap else ''}H {h} for {u:.0%} utilisation")
    if h == auto.max_steps and want > h:
        why += f" (capped at max_inner_steps; {math.ceil(want)} wanted)"
    return h, why


MERGE_MARGIN_STEPS = 0.5
"""Overlap's agreed merge step: steps added to the round's own length (its jitter)."""


def choose_merge_steps(infos: Mapping[str, RoundInfo], current: int | None = None
                       ) -> tuple[int, str] | None:
    """Overlap: the step after the next boundary at which every cluster applies that round's
    average, and why; None unless some cluster said when its last average arrived.
    ``current``: the step in force (kept while the round fits in it with its margin and at
    most one step to spare)."""
    arrivals = [i.arrive_s for i in infos.values() if i.arrive_s is not None]
    steps = [i.step_s for i in infos.values() if i.step_s is not None]
    if not arrivals or not steps:
        return None
    x, t = min(arrivals), min(steps)
    kept = current is not None and (math.ceil(x / t + MERGE_MARGIN_STEPS) <= current
                                    <= math.ceil(x / t + 1))
    k = current if kept and current else max(1, math.ceil(x / t + MERGE_MARGIN_STEPS))
    return k, (f"round {x:.3f} s (arrived last), step {t:.3f} s (fastest): merge after {k} "
               f"steps{' (kept)' if kept else ''}")
