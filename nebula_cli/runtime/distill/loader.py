"""`DistillLoader`: a student's data loader whose every batch arrives with its teacher's
sparse soft labels. It asks for batch n + ``lookahead`` when batch n is taken, so the answer
is there when the step needs it; batches are yielded once each, in the loader's order.

With no teacher answering, ``when_no_teacher`` says what a step does: ``wait`` (up to
``wait_s`` seconds, then `DistillError` naming the teachers), or ``ce_only`` (the batch comes
with ``None``: the step trains on the hard labels; counted in ``stats``). A batch a teacher
cannot run (an id beyond its vocabulary, sequences beyond its context) is a `DistillError`
naming both, whichever ``when_no_teacher``: asking again would fail again.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.errors import NebulaError
from nebula_cli.pki import CertPair, client_context
from nebula_cli.relay.distill.label_client import AskRefused, LabelClient, LabelsFailed
from nebula_cli.relay.distill.sparse import Values
from nebula_cli.runtime import metrics

POLL_S = 0.05
"""How often a ce_only step looks again for its labels while a teacher is linked."""
REPORT_EVERY = 20
"""Batches between two of the loader's metric records (and one when the loader ends)."""


class DistillError(NebulaError):
    """No soft labels where the job waits for them."""


@dataclass(frozen=True)
class SoftLabels:
    """One batch's soft labels: ``ids`` (batch, width, k) int64 and ``logp`` (batch, width, k)
    float32, the teacher's log-probabilities at the job's temperature; ``stats``: the loader's
    figures, where `kd_loss` adds the batch's KD term."""

    ids: torch.Tensor
    logp: torch.Tensor
    teacher: str
    stats: DistillStats | None = field(default=None, compare=False, repr=False)
    vocab: int | None = None
    """The teacher's vocabulary (None: not said); `kd_loss` refuses ids beyond the
    student's."""
    on_policy: bool = False
    """Whether these score the asked tokens (``distill.mode: on_policy``, k = 1: ``logp`` is
    the teacher's log-probability of each position's next token; `on_policy_loss`), not the
    teacher's own labels (`kd_loss`)."""


@dataclass
class DistillStats:
    """What the loader got so far (for metrics and the bench)."""

    batches: int = 0
    without_labels: int = 0
    tokens: int = 0
    wire_bytes: int = 0
    """Bytes of the answers' payloads and of the asks' (their token ids, packed)."""
    ask_bytes: int = 0
    """Of ``wire_bytes``, the asks' (towards the teacher)."""
    latency_s: float = 0.0
    waited_s: float = 0.0
    """Seconds steps spent waiting for their labels."""
    longest_wait_s: float = 0.0
    kd_sum: torch.Tensor | float = 0.0
    """The KD terms `kd_loss` computed since the last record, summed (a tensor on the model's
    device: read once a record, so that a step waits for no device)."""
    kd_steps: int = 0
    ce_sum: torch.Tensor | float = 0.0
    """The hard-label losses `kd_loss` computed since the last record, summed (as kd_sum):
    the student's loss on its own batches, beside its teacher's (`teacher_ce`)."""
    ce_steps: int = 0

    @property
    def bytes_per_token(self) -> float:
        return self.wire_bytes / self.tokens if self.tokens else 0.0

    def add_kd(self, kd: torch.Tensor) -> None:
        """A step's KD term (`kd_loss`)."""
        self.kd_sum = self.kd_sum + kd.detach()
        self.kd_steps += 1

    def add_ce(self, ce: torch.Tensor) -> None:
        """A step's hard-label loss (`kd_loss`, where it has the batch's labels)."""
        self.ce_sum = self.ce_sum + ce.detach()
        self.ce_steps += 1

    def record(self) -> dict[str, Any]:
        """The figures as metric values (``nebula status`` shows them per cluster):
        ``distill_kd`` and ``distill_ce`` are the mean KD term and hard-label loss of the steps
        since the last record (None without one)."""
        kd = float(self.kd_sum) / self.kd_steps if self.kd_steps else None
        ce = float(self.ce_sum) / self.ce_steps if self.ce_steps else None
        self.kd_sum, self.kd_steps = 0.0, 0
        self.ce_sum, self.ce_steps = 0.0, 0
        return {"distill_batches": self.batches, "distill_without_labels": self.without_labels,
                "distill_bytes_per_token": round(self.bytes_per_token, 2),
                "distill_wait_s": round(self.waited_s, 3),
                "distill_longest_wait_s": round(self.longest_wait_s, 3),
                "distill_kd": None if kd is None else round(kd, 5),
                "distill_ce": None if ce is None else round(ce, 5)}


def _token_ids(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return batch["input_ids"]
    return batch[0]


class DistillLoader:
    """Yields ``(batch, SoftLabels | None)`` for every batch of ``loader``; every
    ``report_every`` batches, and when the loader ends, a metric record of its `DistillStats`
    (``distill_batches``, ``distill_without_labels``, ...) in the job's metrics (0: none)."""

    def __init__(self, loader: Iterable[Any], client: LabelClient, *, lookahead: int,
                 when_no_teacher: str, wait_s: float,
                 token_ids: Callable[[Any], torch.Tensor] = _token_ids,
                 first_seq: int = 0, report_every: int = REPORT_EVERY,
                 vocab: int | None = None) -> None:
        """``vocab``: the student's vocabulary where the spec declares it (`distill.vocab`):
        a teacher whose answer says another is refused, both named."""
        if when_no_teacher not in ("wait", "ce_only"):
            raise ValueError(f"when_no_teacher is 'wait' or 'ce_only', not {when_no_teacher!r}")
        self.loader, self.client, self.lookahead = loader, client, lookahead
        self.when_no_teacher, self.wait_s, self.token_ids = when_no_teacher, wait_s, token_ids
        self.seq = first_seq
        self.taken = first_seq - 1
        """The number of the last batch yielded."""
        self.report_every, self.vocab = report_every, vocab
        self.stats = DistillStats()

    def __iter__(self) -> Iterator[tuple[Any, SoftLabels | None]]:
        source = iter(self.loader)
        window: collections.deque[tuple[int, Any, tuple[int, ...]]] = collections.deque()

        def fill() -> None:
            while len(window) <= self.lookahead:
                try:
                    batch = next(source)
                except StopIteration:
                    return
                ids = self.token_ids(batch)
                seq, self.seq = self.seq, self.seq + 1
                try:
                    self.client.ask(seq, ids.detach().cpu().numpy())
                except AskRefused as exc:
                    raise DistillError(f"batch {seq}: {exc}") from None
                window.append((seq, batch, tuple(ids.shape)))

        fill()
        while window:
            seq, batch, shape = window.popleft()
            fill()
            labels = self._labels(seq, shape)
            self.taken = seq
            if self.report_every and self.stats.batches % self.report_every == 0:
                self.report()
            yield batch, labels
        if self.report_every and self.stats.batches % self.report_every:
            self.report()

    def report(self) -> None:
        """A metric record of the figures now (the loader makes one every ``report_every``
        batches and one when its batches end; a script that stops taking batches before
        then makes the last one with this)."""
        metrics.emit(step=self.taken + 1, **self.stats.record())

    def _labels(self, seq: int, shape: tuple[int, ...]) -> SoftLabels | None:
        try:
            return self._wait_labels(seq, shape)
        except LabelsFailed as exc:
            raise DistillError(f"batch {seq}: {exc}") from None

    def _wait_labels(self, seq: int, shape: tuple[int, ...]) -> SoftLabels | None:
        start = time.monotonic()
        if self.when_no_teacher == "wait":
            got = self.client.take(seq, self.wait_s)
            if got is None:
                raise DistillError(
                    f"no soft labels for batch {seq} within {self.wait_s:g} s from the teachers "
                    f"{', '.join(self.client.teachers)} (linked now: "
                    f"{', '.join(self.client.live()) or 'none'}); check that their clusters "
                    "run, or set distill.when_no_teacher: ce_only to train on without them")
        else:
            got = None
            while got is None and self.client.live() and time.monotonic() - start < self.wait_s:
                got = self.client.take(seq, POLL_S)
            if got is None:
                got = self.client.take(seq, 0)
        waited = time.monotonic() - start
        self.stats.batches += 1
        self.stats.waited_s += waited
        self.stats.longest_wait_s = max(self.stats.longest_wait_s, waited)
        tokens = int(np.prod(shape))
        self.stats.tokens += tokens
        if got is None:
            self.client.forget(seq)
            self.stats.without_labels += 1
            return None
        if self.vocab is not None and got.vocab is not None and got.vocab != self.vocab:
            raise DistillError(
                f"teacher {got.teacher}'s model has a vocabulary of {got.vocab:,} and this "
                f"student's (distill.vocab) is {self.vocab:,}: a student learns only from a "
                "teacher with its own tokenizer and vocabulary")
        self.stats.wire_bytes += got.ask_bytes + got.wire_bytes
        self.stats.ask_bytes += got.ask_bytes
        self.stats.latency_s += got.latency_s
        k = got.labels.k
        return SoftLabels(torch.from_numpy(got.labels.ids).reshape(*shape, k),
                          torch.from_numpy(got.labels.logp).reshape(*shape, k), got.teacher,
                          self.stats, got.vocab, got.scored)


def client_of(cfg: DistillConfig, rank: int | None = None) -> LabelClient:
    """A started `LabelClient` to the job's teachers, with this host's certificates, as rank
    ``rank`` of its cluster (default: ``RANK``, as nebula starts a student's processes)."""
    ctx = client_context(CertPair(Path(cfg.tls.cert), Path(cfg.tls.key)), Path(cfg.tls.ca))
    return LabelClient(cfg.teachers, ctx, job_id=cfg.job_id, max_tokens=cfg.max_tokens,
                       topk=cfg.topk, dead_after=cfg.dead_after,
                       rank=int(os.environ.get("RANK", "0")) if rank is None else rank).start()


def job_config(config: DistillConfig | None, on_policy: bool) -> DistillConfig:
    """``config``, or the job's distill.json (``NEBULA_DISTILL_CONFIG``); a DistillError when
    there is none, or when its `distill.mode` is not the one the script's loader is for."""
    cfg = config
    if cfg is None:
        path = os.environ.get(DISTILL_CONFIG_ENV)
        if not path:
            raise DistillError(f"{DISTILL_CONFIG_ENV} is not set: this process was not started "
                               "by nebula for a job with `distill:`")
        cfg = DistillConfig.load(path)
    if (Values(cfg.values) is Values.TOKEN) != on_policy:
        raise DistillError(
            "the job's distill.mode is on_policy: its teachers score the students' samples; "
            "take batches from distill.on_policy(loader, sample=...)" if not on_policy else
            "the job's distill.mode is off_policy: its teachers send their own labels; take "
            "batches from distill.soft_labelled(loader), or set distill.mode: on_policy")
    return cfg


def soft_labelled(loader: Iterable[Any], config: DistillConfig | None = None,
                  rank: int | None = None, **kw: Any) -> DistillLoader:
    """``loader`` with soft labels, as the job's distill.json (``NEBULA_DISTILL_CONFIG``, or
    ``config``) says; ``kw``: `DistillLoader`'s own arguments (``token_ids``, ``first_seq``:
    the first batch's number, e.g. the step a resumed run starts at); ``rank``: this
    process's in its cluster (default ``RANK``)."""
    cfg = job_config(config, on_policy=False)
    return DistillLoader(loader, client_of(cfg, rank), lookahead=cfg.lookahead,
                         when_no_teacher=cfg.when_no_teacher, wait_s=cfg.wait_s,
                         **{"vocab": cfg.vocab, **kw})
