"""bench/peers.py's figures: from each system's records (`_peers_jobs.Job`) to its row, and from
the rows of every seed to the ratios of the JSON line.

Row (one system, one seed):
- `time_to_target_s`: from the end of step 1 (the first worker's step-1 record) to the first
  evaluation whose eval loss, averaged over the workers that evaluated at that step, is at or
  below the target (flat's final eval loss + 3 %); the time is that evaluation's latest record.
  Every system evaluates at each of its sync boundaries (after the round: the model every
  cluster shares), flat every `eval_every` steps. None: never reached in the run.
- `eval_loss`: the final eval loss averaged over all workers, after the same number of steps,
  so of tokens, for every system (equal tokens).
- `tokens_per_s`: tokens of one step of all workers / the slowest worker's s_per_step (steps
  2..N, rounds and evaluations included, as train.py reports it).
- `wan_bytes_per_token`: the bytes the router's htb classes counted between the clusters during
  the job / the job's tokens.
- `identical`: every worker wrote a final record and all their parameter checksums are equal.

Ratios (nebula's best row over the best peer's, per seed, then the median over seeds): time to
target and bytes per token (below 1: nebula better), final eval loss at equal tokens (at or
below 1: nebula's loss equal or lower). Goals: time <= 1/1.5, bytes <= 1/10, loss <= 1.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from _peers_jobs import Job

TARGET_MARGIN = 0.03
PEERS = ("torchft", "hivemind")
NEBULA = ("nebula-int8", "nebula-topk", "nebula-auto")
FLAT = "flat"
GOALS = {"time_to_target_vs_best_peer": 1 / 1.5, "bytes_vs_best_peer": 0.1,
         "loss_at_equal_tokens_vs_best_peer": 1.0}
JSON_FIELDS = ("time_to_target_vs_best_peer", "bytes_vs_best_peer",
               "loss_at_equal_tokens_vs_best_peer", "rows", "seeds", "goals_met")


@dataclass
class Row:
    """One system's figures on one seed (or `error`: what failed, and nothing else)."""

    system: str
    seed: int
    error: str | None = None
    time_to_target_s: float | None = None
    eval_loss: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    wan_bytes: int | None = None
    wan_bytes_per_token: float | None = None
    identical: bool | None = None
    s_per_step: float | None = None
    wall_s: float | None = None
    curve: list[tuple[int, float, float]] | None = None
    """(step, eval loss, seconds since the end of step 1) at each evaluation."""
    notes: dict[str, Any] | None = None


def curve(records: list[dict[str, Any]]) -> tuple[float, list[tuple[int, float, float]]]:
    """The start instant (end of step 1) and the eval loss by step with its latest time."""
    starts = [float(r["ts"]) for r in records if r.get("step") == 1 and "loss" in r
              and not r.get("final")]
    if not starts:
        raise ValueError("no step-1 record")
    t0 = min(starts)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if "eval_loss" in r and not r.get("final") and r.get("eval_loss") is not None:
            by_step.setdefault(int(r["step"]), []).append(r)
    points = [(step, statistics.fmean(float(r["eval_loss"]) for r in rs),
               max(float(r["ts"]) for r in rs) - t0) for step, rs in sorted(by_step.items())]
    return t0, points


def row(job: Job, seed: int, target: float | None) -> Row:
    """A job's figures (see the module doc); `target` None: time to target not computed."""
    finals = [r for r in job.records if r.get("final")]
    if len(finals) != job.workers:
        return Row(job.name, seed, error=f"{len(finals)} final records of {job.workers} workers")
    _, points = curve(job.records)
    s_step = max(float(r["s_per_step"]) for r in finals)
    tokens = job.tokens_per_step * job.steps
    reached = [t for _, loss, t in points if target is not None and loss <= target]
    return Row(job.name, seed,
               time_to_target_s=round(reached[0], 2) if reached else None,
               eval_loss=round(statistics.fmean(float(r["eval_loss"]) for r in finals), 4),
               tokens=tokens, tokens_per_s=round(job.tokens_per_step / s_step, 1),
               wan_bytes=job.wan_bytes, wan_bytes_per_token=round(job.wan_bytes / tokens, 2),
               identical=len({r["param_sha256"] for r in finals}) == 1,
               s_per_step=round(s_step, 4), wall_s=round(job.wall_s, 1),
               curve=[(s, round(loss, 4), round(t, 2)) for s, loss, t in points],
               notes=job.notes or None)


def target_of(flat: Row) -> float | None:
    return None if flat.eval_loss is None else flat.eval_loss * (1 + TARGET_MARGIN)


def _best(rows: list[Row], key: str) -> Row | None:
    known = [r for r in rows if r.error is None and getattr(r, key) is not None]
    return min(known, key=lambda r: getattr(r, key)) if known else None


def seed_ratios(rows: list[Row]) -> dict[str, Any]:
    """One seed's three ratios and which rows they compare (None where a side is missing)."""
    out: dict[str, Any] = {}
    for name, key in (("time_to_target_vs_best_peer", "time_to_target_s"),
                      ("bytes_vs_best_peer", "wan_bytes_per_token"),
                      ("loss_at_equal_tokens_vs_best_peer", "eval_loss")):
        ours = _best([r for r in rows if r.system in NEBULA], key)
        peer = _best([r for r in rows if r.system in PEERS], key)
        value = None
        if ours is not None and peer is not None and getattr(peer, key):
            value = round(getattr(ours, key) / getattr(peer, key), 4)
        out[name] = {"value": value, "nebula": ours.system if ours else None,
                     "peer": peer.system if peer else None}
    return out


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def summarize(rows: list[Row], seeds: list[int], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON object: JSON_FIELDS first (each ratio the median over seeds), then the target,
    each seed's ratios and the settings."""
    per_seed = {seed: seed_ratios([r for r in rows if r.seed == seed]) for seed in seeds}
    out: dict[str, Any] = {}
    for key in JSON_FIELDS[:3]:
        out[key] = median([per_seed[s][key]["value"] for s in seeds])
    out["rows"] = [{k: v for k, v in asdict(r).items() if v is not None} for r in rows]
    out["seeds"] = seeds
    out["goals_met"] = {k: out[k] is not None and out[k] <= goal for k, goal in GOALS.items()}
    out["targets"] = {str(r.seed): round(t, 4) for r in rows
                      if r.system == FLAT and (t := target_of(r)) is not None}
    out["per_seed"] = {str(s): v for s, v in per_seed.items()}
    out["settings"] = settings
    return out


def table(rows: list[Row]) -> list[list[Any]]:
    """Rows of the printed table."""
    return [[r.system, r.seed, r.time_to_target_s, r.eval_loss, r.tokens_per_s,
             r.wan_bytes_per_token, None if r.identical is None
             else ("yes" if r.identical else "NO"), r.wall_s,
             (r.error or "").splitlines()[0][:60] if r.error else ""] for r in rows]
