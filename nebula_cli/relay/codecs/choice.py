"""``compression: auto``: which codec the next round uses, decided by the round's coordinator
from what the READYs carried (:class:`~nebula_cli.relay.protocol.pacing.RoundInfo`). Pure functions
of those measurements and of :class:`CodecCosts`, the little the coordinator remembers between
rounds; unit-tested with made-up figures.

The rule (the Nebula-I paper's "adaptive communication acceleration", made explicit):
**sync as often as the utilisation target allows, and at that frequency as faithfully as the
link allows.** For each candidate codec (``AutoCodec.codecs``, the most faithful first: int8,
then topk) the coordinator predicts its round cost ``c_x`` and the number of steps that must
pass between rounds for the clusters to spend ``u`` of their time training
(:func:`~nebula_cli.relay.protocol.pacing.steps_wanted`: ``u / (1 - u) * c_x / t``, or ``c_x / (u
t)`` with overlap; ``t`` the slowest cluster's step time).

- With ``inner_steps: auto`` each codec gets the H it needs (clamped to min/max_inner_steps);
  the chosen codec is the most faithful one whose H is at most :data:`SLACK` times the
  smallest H any candidate needs (and that reaches the target below max_inner_steps at all),
  and the next round's H is that codec's.
- With a fixed H (or time-based rounds, ``sync.every``) the chosen codec is the most faithful
  one whose round fits behind those steps (seconds) at the target.
- When none qualifies, the sparsest codec.

Predicting ``c_x``: the cost measured for the codec the previous round used is the cheapest
cluster's ``comm_s``; another codec's is that cost times the ratio of the two codecs' costs
measured in two consecutive rounds that used them (a switch teaches it), or, before any switch,
the ratio of their payload bytes per element. A codec more faithful than the current one must
fit with :data:`DENSER_MARGIN` to spare, so that noise does not make the codec flap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from nebula_cli.config.relay_config import AutoCodec, AutoSteps
from nebula_cli.relay.protocol.pacing import RoundInfo, steps_wanted

SLACK = 2.0
"""With ``inner_steps: auto``, a more faithful codec is chosen while it needs at most this
many times the H of the codec that allows the most frequent rounds. Measured
(docs/benchmarks.md, bench/diloco_schedule.py): int8 every 10 steps ends below topk every 5
on the hetero bench's batch (1.82 % against 3.42 % loss gap), while int8 every 25 steps ends
above topk every 10 on wan_training's (3.29 % against 2.11 %): int8 is worth between 1x and
2.5x the rounds."""
DENSER_MARGIN = 1.25
"""A codec more faithful than the current one is predicted this much more expensive than its
estimate (it must fit with a quarter to spare)."""


@dataclass
class CodecCosts:
    """What the coordinator remembers between rounds: the newest measured round cost and the
    ratios of codecs' costs seen across a switch."""

    last: tuple[str, float] | None = None
    """(codec, round cost in seconds) of the newest measurement."""
    ratio: dict[tuple[str, str], float] = field(default_factory=dict)
    """(a, b) -> cost with a / cost with b, measured in consecutive rounds."""

    def note(self, codec: str, cost: float) -> None:
        """A round with ``codec`` cost ``cost`` seconds."""
        if self.last is not None and self.last[0] != codec and cost > 0 and self.last[1] > 0:
            self.ratio[(self.last[0], codec)] = self.last[1] / cost
            self.ratio[(codec, self.last[0])] = cost / self.last[1]
        self.last = (codec, cost)

    def predict(self, codec: str, nbytes: Mapping[str, float]) -> float | None:
        """The round cost ``codec`` would have now (None before any measurement)."""
        if self.last is None:
            return None
        measured, cost = self.last
        if codec == measured:
            return cost
        r = self.ratio.get((codec, measured))
        if r is None:
            r = nbytes[codec] / nbytes[measured] if nbytes.get(measured) else 1.0
        return cost * r


@dataclass(frozen=True)
class CodecChoice:
    codec: str
    h: int | None
    """With ``inner_steps: auto``, the H that goes with the codec; else None."""
    why: str


def choose_codec(auto: AutoCodec, steps: AutoSteps | None, current: str,
                 infos: Mapping[str, RoundInfo], costs: CodecCosts,
                 nbytes: Mapping[str, float]) -> CodecChoice | None:
    """The next round's codec (and H with ``steps``), from this round's READYs; None (keep
    the current codec and H) before there is a step time and a round cost to go by.

    ``current``: the codec of the round being decided; ``nbytes``: each candidate's payload
    bytes per element. Notes the measurement in ``costs``."""
    timed = [i for i in infos.values() if i.comm_s is not None and i.codec in nbytes]
    step_times = [i.step_s for i in infos.values() if i.step_s is not None]
    if timed:  # the codec most clusters' previous round used (a fetched round may differ)
        names = [i.codec for i in timed]
        used = max(names, key=names.count)
        cheapest = min((i for i in timed if i.codec == used), key=lambda i: i.comm_s or 0.0)
        costs.note(str(used), float(cheapest.comm_s or 0.0))
    if not step_times or not timed:
        return None
    t, u = max(step_times), auto.target_utilization
    codecs = [c for c in auto.codecs if c in nbytes]
    rank = {c: i for i, c in enumerate(codecs)}
    predicted: dict[str, float] = {}
    for c in codecs:
        cost = costs.predict(c, nbytes)
        if cost is None:
            return None
        predicted[c] = cost * (DENSER_MARGIN if rank[c] < rank.get(current, 0) else 1.0)
    want = {c: steps_wanted(predicted[c], t, u, auto.overlap) for c in codecs}
    if steps is not None:
        h = {c: min(steps.max_steps, max(steps.min_steps, math.ceil(want[c] - 1e-9)))
             for c in codecs}
        fastest = min(h.values())
        fit = [c for c in codecs if want[c] <= steps.max_steps and h[c] <= SLACK * fastest]
        chosen = fit[0] if fit else codecs[-1]
        rule = f"H {h[chosen]} (the most frequent: {fastest}, x{SLACK:g} allowed)"
        next_h: int | None = h[chosen]
    else:
        budget = (auto.budget_s / t if auto.budget_s is not None
                  else float(auto.budget_steps or 1))
        fit = [c for c in codecs if want[c] <= budget]
        chosen, next_h = (fit[0] if fit else codecs[-1]), None
        rule = f"{'fits' if fit else 'none fits'} behind {budget:.3g} steps"
    measured = costs.last
    assert measured is not None
    why = (f"{chosen} for {u:.0%} utilisation: step {t:.3f} s, round {measured[1]:.3f} s with "
           f"{measured[0]}; predicted " + ", ".join(f"{c} {predicted[c]:.3f} s"
                                                     for c in codecs) + f"; {rule}")
    return CodecChoice(chosen, next_h, why)
