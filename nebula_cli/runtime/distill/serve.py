"""`serve(forward)`: a teacher process answers the students' soft-label asks with its model.

``forward`` maps token ids (sequences, width) int64 to logits (sequences, width, vocab); the
process takes the top k at the job's temperature and sends them through its cluster's label
relay, which rank 0 of the teacher cluster runs (on the cluster's first host, the relay's:
``gateway`` must be left at its default). Every rank (rank 0 too) serves; they share the
students' asks. Runs until SIGTERM or SIGINT (or ``stop``).

Rank 0 writes the label relay's figures into the job's metrics every `REPORT_S` seconds and
when it stops (`teacher_record`: answers per second, their latency, the queue, and the
teacher's own loss on the students' batches it answered, `TeacherLoss`), which
``nebula status``, the live view and ``nebula report`` show for the teacher cluster. A
record's ``step`` is the number of answers so far (a teacher takes no optimizer steps).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.pki import CertPair, client_context
from nebula_cli.relay.distill.dial import split_addr
from nebula_cli.relay.distill.label_relay import LabelRelay, RelayCounts
from nebula_cli.relay.distill.serve_link import ServeLink
from nebula_cli.relay.distill.sparse import SparseLabels, Values, from_draws, next_tokens
from nebula_cli.relay.distill.student_links import max_asks
from nebula_cli.runtime import metrics
from nebula_cli.runtime.distill.loss import sampled_labels, token_logprobs, topk_labels

log = logging.getLogger("nebula.distill")

REPORT_S = 5.0
"""Seconds between a teacher's metric records."""

Forward = Callable[[torch.Tensor], torch.Tensor]

LOSS_CHUNK = 1 << 24
"""Logits (elements) the teacher's own loss takes at once: its log-softmax is one more such
tensor, not one more copy of a whole ask's logits."""


class TeacherLoss:
    """The teacher's next-token cross entropy (nats, at temperature 1) on the sequences it was
    asked for: the students' own batches, so that it stands beside the students' loss on them
    (a teacher no better than its students cannot teach them). Added to by the serving link's
    thread, taken by the figures' thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum, self._tokens = 0.0, 0

    def add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Sequences' logits (sequences, width, vocab) and their token ids (sequences, width):
        position t scored on token t + 1."""
        sequences, width, vocab = logits.shape
        if width < 2:
            return
        rows = max(1, LOSS_CHUNK // (width * vocab))  # the log-softmax of a few sequences at once
        nll = sum(float(torch.nn.functional.cross_entropy(
            logits[i:i + rows, :-1].transpose(1, 2).float(), tokens[i:i + rows, 1:],
            reduction="sum")) for i in range(0, sequences, rows))
        with self._lock:
            self._sum += nll
            self._tokens += sequences * (width - 1)

    def take(self) -> float | None:
        """The mean since the last take (None: nothing scored), and start again."""
        with self._lock:
            mean = self._sum / self._tokens if self._tokens else None
            self._sum, self._tokens = 0.0, 0
        return mean


def answerer(forward: Forward, cfg: DistillConfig, device: str | torch.device = "cpu",
             loss: TeacherLoss | None = None) -> Callable[..., SparseLabels]:
    """What a serving link calls: token ids (numpy) -> every position's labels: its top k, or
    (``values: draws``) k tokens drawn from its distribution, seeded by the tokens, or
    (``values: token``, on-policy) its log-probability of each next token; ``loss`` adds up
    the teacher's own loss on them."""

    values = Values(cfg.values)
    drawn = values is Values.DRAWS

    @torch.no_grad()
    def answer(tokens):  # type: ignore[no-untyped-def]
        ids_in = torch.from_numpy(tokens).to(device)
        logits = forward(ids_in)
        if loss is not None:
            loss.add(logits, ids_in)
        if values is Values.TOKEN:  # the students' samples, scored
            logp = token_logprobs(logits, ids_in, 1.0)  # as the student samples: at T = 1
            return SparseLabels(next_tokens(tokens, tokens.shape[-1]), logp.cpu().numpy())
        if drawn:  # the same tokens draw the same labels, on any replica, after any restart
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(int.from_bytes(hashlib.blake2b(
                np.ascontiguousarray(tokens).tobytes(), digest_size=8).digest()) >> 1)
            draws = sampled_labels(logits, cfg.topk, cfg.temperature, gen)
            return from_draws(draws.cpu().numpy())
        ids, logp = topk_labels(logits, cfg.topk, cfg.temperature)
        return SparseLabels(ids.cpu().numpy(), logp.cpu().numpy())

    return answer


def teacher_record(before: RelayCounts, now: RelayCounts, seconds: float,
                   ce: float | None = None) -> dict[str, Any]:
    """The label relay's figures over an interval of ``seconds`` (``before``: its counts at the
    interval's start) as metric values: answers so far, answers per second and their mean
    latency in the interval (None without answers), the queue, servers and students now, and
    ``ce``: the teacher's loss on the batches rank 0 answered in it (`TeacherLoss`)."""
    answers = now.answers - before.answers
    latency = (now.latency_s - before.latency_s) / answers if answers else None
    return {"teacher_answers": now.answers, "teacher_tokens": now.tokens,
            "teacher_answers_per_s": round(answers / seconds, 3) if seconds > 0 else None,
            "teacher_latency_ms": None if latency is None else round(1000 * latency, 1),
            "teacher_queue": now.pending, "teacher_servers": now.servers,
            "teacher_students": now.students,
            "teacher_ce": None if ce is None else round(ce, 5)}


def report_figures(relay: LabelRelay, served: threading.Event, every: float,
                   loss: TeacherLoss | None = None) -> None:
    """Rank 0: a record of `teacher_record` every ``every`` seconds, and one when ``served``;
    ``loss``: rank 0's own (a record without answers keeps the last one said)."""
    before, since = relay.counts(), time.monotonic()
    ce = None
    while True:
        stopped = served.wait(every)
        now, at = relay.counts(), time.monotonic()
        if loss is not None and (latest := loss.take()) is not None:
            ce = latest
        try:
            metrics.emit(step=now.answers, **teacher_record(before, now, at - since, ce))
        except OSError as exc:  # a full disk, say: serving goes on, the figures come back
            log.warning("teacher %s: could not write its figures: %s", relay.cluster, exc)
        if stopped:
            return
        before, since = now, at


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def serve(forward: Forward, *, vocab: int | None = None, context: int | None = None,
          config: DistillConfig | None = None, rank: int | None = None,
          stop: threading.Event | None = None, device: str | torch.device = "cpu") -> None:
    """Serve soft labels with ``forward`` until stopped (see the module's docstring).
    ``vocab``: the model's vocabulary (default: the last dimension of one forward);
    ``context``: the most positions it runs (default: ``distill.max_tokens``). Asks beyond
    either fail, naming both, before the model sees them."""
    cfg = config or DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    if not cfg.teacher:
        raise ValueError(f"cluster {cfg.cluster} is a student: its distill.json serves nothing")
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    stop = stop or _stop_on_signals()
    pair, ca = CertPair(Path(cfg.tls.cert), Path(cfg.tls.key)), Path(cfg.tls.ca)
    if vocab is None:
        with torch.no_grad():
            vocab = int(forward(torch.zeros(1, 1, dtype=torch.long, device=device)).shape[-1])
    context = min(context or cfg.max_tokens, cfg.max_tokens)
    relay = None
    if rank == 0:
        host, port = split_addr(cfg.listen)
        relay = LabelRelay(job_id=cfg.job_id, cluster=cfg.cluster, students=cfg.students,
                           pair=pair, ca=ca, bind=host, port=port, topk=cfg.topk,
                           values=Values(cfg.values), max_tokens=cfg.max_tokens,
                           vocab=vocab, context=context, max_asks=max_asks(cfg.lookahead),
                           heartbeat=cfg.dead_after / 4, dead_after=cfg.dead_after).start()
    addr = cfg.teachers[cfg.cluster]
    if relay is not None:  # its own relay, reached where it listens
        bound = split_addr(cfg.listen)[0]
        addr = f"{'127.0.0.1' if bound in ('', '0.0.0.0', '::') else bound}:{relay.port}"
    loss = TeacherLoss() if relay is not None else None
    link = ServeLink(addr, client_context(pair, ca), job_id=cfg.job_id, cluster=cfg.cluster,
                     vocab=vocab, context=context,
                     answer=answerer(forward, cfg, device, loss))
    reporter, served = None, threading.Event()
    if relay is not None:
        reporter = threading.Thread(target=report_figures,
                                    args=(relay, served, REPORT_S, loss),
                                    daemon=True, name="teacher-figures")
        reporter.start()
    try:
        link.run(stop)
    finally:
        served.set()
        if reporter is not None:
            reporter.join(timeout=5.0)
        if relay is not None:
            relay.close()
        log.info("teacher %s: %d answers served", cfg.cluster, link.answered)
