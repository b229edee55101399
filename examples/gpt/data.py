"""The bundled byte-level corpus: loading, a fixed train/eval split, batches, evaluation.

Split: the corpus is cut into ``BLOCK_BYTES`` blocks; every ``EVAL_EVERY``-th block
(indices ``EVAL_EVERY-1, 2*EVAL_EVERY-1, ...``) goes to evaluation (5 %), the rest to
training (95 %). Both sides are concatenations of whole blocks, so they never overlap.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
BLOCK_BYTES = 2048
EVAL_EVERY = 20


def load_corpus(path: str | Path = CORPUS) -> bytes:
    """The corpus as raw bytes (one byte = one token)."""
    return Path(path).read_bytes()


@dataclass(frozen=True)
class Split:
    """Train and eval token streams (uint8 tensors)."""

    train: torch.Tensor
    eval: torch.Tensor


def split_corpus(data: bytes, block: int = BLOCK_BYTES, eval_every: int = EVAL_EVERY) -> Split:
    """Deterministic 95/5 split by blocks (see the module docstring)."""
    blocks = [data[i : i + block] for i in range(0, len(data), block)]
    train = b"".join(b for i, b in enumerate(blocks) if i % eval_every != eval_every - 1)
    held = b"".join(b for i, b in enumerate(blocks) if i % eval_every == eval_every - 1)
    return Split(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        eval=torch.frombuffer(bytearray(held), dtype=torch.uint8),
    )


def _seed(*parts: int | str) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = tokens[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


class BatchSampler:
    """Random training windows ``(x, y)`` with y = x shifted by one byte.

    Seeded by ``(seed, cluster, rank)``: each rank of each cluster draws its own stream,
    and the same triple always draws the same stream.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        context: int,
        *,
        seed: int,
        rank: int = 0,
        cluster: int = 0,
    ) -> None:
        if len(tokens) <= context + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for a context of {context}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.context = context
        self.generator = torch.Generator().manual_seed(_seed("train", seed, cluster, rank))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = len(self.tokens) - self.context - 1
        starts = torch.randint(0, high + 1, (self.batch_size,), generator=self.generator)
        return _windows(self.tokens, starts, self.context)


def eval_batches(
    tokens: torch.Tensor, n_batches: int, batch_size: int, context: int, *, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of eval batches: the same for every rank and cluster given the same seed."""
    gen = torch.Generator().manual_seed(_seed("eval", seed))
    high = len(tokens) - context - 1
    return [
        _windows(tokens, torch.randint(0, high + 1, (batch_size,), generator=gen), context)
        for _ in range(n_batches)
    ]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> float:
    """Mean loss of ``model`` over ``batches`` (nan for an empty list); restores train mode."""
    if not batches:
        return float("nan")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for x, y in batches:
            _, loss = model(x.to(device), y.to(device))
            total += float(loss)
        return total / len(batches)
    finally:
        model.train(was_training)
