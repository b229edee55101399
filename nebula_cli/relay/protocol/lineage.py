"""Lineage: a short name for the history of a cluster's global parameters, so that relays
notice when their clusters no longer hold the same theta_global and heal it.

Relays can end a round differently: a link that drops in the middle of an exchange can leave
one relay with the joint average while its peer, unable to fetch it, averages alone. From then
on the two clusters' parameters differ, and nothing in the round protocol would ever bring them
back together. The lineage makes that visible and repairable:

- Before round 0 every relay's lineage is :data:`GENESIS` (every worker starts from the same
  initial weights). A relay that (re)starts in the middle of a job does not know its cluster's
  history: its lineage is :data:`UNKNOWN` until it takes a peer's state.
- A round that applied an average advances the lineage: ``advance(prev, round, present,
  average)`` hashes the previous lineage, the round, who was in it and the average (results are
  bit-identical on every relay that completed the round, so relays in step stay equal). A round
  that applied nothing (zero update) leaves it as it was; taking a peer's published global state
  takes that state's lineage.
- Every READY carries the relay's lineage. The coordinator keeps in the round only the clusters
  on the **winning lineage** (:func:`winner`): the known lineage held by most of the clusters
  that are ready, ties going to the one held by the cluster earliest in the job's order. The
  others are told they *diverged* and take a present peer's published global state (theta and,
  when the workers publish it, the outer momentum) instead of contributing. A relay with an
  unknown lineage never wins while a known one is present.

The rule is evaluated by the coordinator only, on the READY messages it holds; its decision
travels with the round's START like the rest of the membership. Divergence therefore lasts at
most one round after the clusters can talk again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

GENESIS = "genesis"
UNKNOWN = "unknown"
SAMPLED_ABOVE = 1 << 22
"""Averages above this many elements are hashed on a sample of this size: SAMPLE_PIECES
contiguous pieces evenly spread over it (a diverged average differs everywhere; hashing 4M
values costs a few milliseconds, and contiguous pieces are read without touching the rest)."""
SAMPLE_PIECES = 64


def initial(first_round: int) -> str:
    """The lineage of a relay whose first round is ``first_round``."""
    return GENESIS if first_round == 0 else UNKNOWN


def tensor_digest(x: torch.Tensor) -> str:
    """A digest of a flat fp32 tensor's bytes (sampled when it is large)."""
    flat = x.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    n = flat.numel()
    h = hashlib.blake2b(digest_size=16)
    if n <= SAMPLED_ABOVE:
        h.update(flat.numpy())
    else:
        piece, step = SAMPLED_ABOVE // SAMPLE_PIECES, n // SAMPLE_PIECES
        for lo in range(0, SAMPLE_PIECES * step, step):
            h.update(flat[lo : lo + piece].numpy())
    return h.hexdigest()


def advance(prev: str, round_id: int, present: Sequence[str], average: torch.Tensor,
            codec: str = "") -> str:
    """The lineage after ``round_id`` applied ``average`` (of ``present``, encoded with
    ``codec``: its workers apply it with that codec's outer settings) on top of ``prev``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{prev}|{round_id}|{','.join(sorted(present))}|{codec}|".encode())
    h.update(tensor_digest(average).encode())
    return h.hexdigest()


def winner(lineages: Mapping[str, str], order: Sequence[str]) -> str | None:
    """The lineage the round keeps: the known one held by most clusters, ties to the one of
    the cluster earliest in ``order``; None when nobody's lineage is known."""
    known = [c for c in order if c in lineages and lineages[c] != UNKNOWN]
    if not known:
        return None
    counts: dict[str, int] = {}
    for c in known:
        counts[lineages[c]] = counts.get(lineages[c], 0) + 1
    best = max(counts.values())
    return next(lineages[c] for c in known if counts[lineages[c]] == best)


def diverged(lineages: Mapping[str, str], order: Sequence[str]) -> list[str]:
    """The clusters (of ``lineages``, in ``order``) that are not on the winning lineage."""
    win = winner(lineages, order)
    if win is None:
        return []
    return [c for c in order if c in lineages and lineages[c] != win]
