"""`serve(forward)`: a teacher process answers the students' soft-label asks with its model.

``forward`` maps token ids (sequences, width) int64 to logits (sequences, width, vocab); the
process takes the top k at the job's temperature and sends them through its cluster's label
relay, which rank 0 of the teacher cluster runs (on the cluster's first host, the relay's:
``gateway`` must be left at its default). Every rank (rank 0 too) serves; they share the
students' asks. Runs until SIGTERM or SIGINT (or ``stop``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from nebula_cli.config.distill_config import DISTILL_CONFIG_ENV, DistillConfig
from nebula_cli.pki import CertPair, client_context
from nebula_cli.relay.distill.dial import split_addr
from nebula_cli.relay.distill.label_relay import LabelRelay
from nebula_cli.relay.distill.serve_link import ServeLink
from nebula_cli.relay.distill.sparse import SparseLabels, Values
from nebula_cli.runtime.distill.loss import topk_labels

log = logging.getLogger("nebula.distill")

Forward = Callable[[torch.Tensor], torch.Tensor]


def answerer(forward: Forward, cfg: DistillConfig, device: str | torch.device = "cpu"
             ) -> Callable[..., SparseLabels]:
    """What a serving link calls: token ids (numpy) -> the top k of every position."""

    @torch.no_grad()
    def answer(tokens):  # type: ignore[no-untyped-def]
        logits = forward(torch.from_numpy(tokens).to(device))
        ids, logp = topk_labels(logits, cfg.topk, cfg.temperature)
        return SparseLabels(ids.cpu().numpy(), logp.cpu().numpy())

    return answer


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def serve(forward: Forward, *, vocab: int | None = None, config: DistillConfig | None = None,
          rank: int | None = None, stop: threading.Event | None = None,
          device: str | torch.device = "cpu") -> None:
    """Serve soft labels with ``forward`` until stopped (see the module's docstring).
    ``vocab``: the model's vocabulary (default: the last dimension of one forward)."""
    cfg = config or DistillConfig.load(os.environ[DISTILL_CONFIG_ENV])
    if not cfg.teacher:
        raise ValueError(f"cluster {cfg.cluster} is a student: its distill.json serves nothing")
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    stop = stop or _stop_on_signals()
    pair, ca = CertPair(Path(cfg.tls.cert), Path(cfg.tls.key)), Path(cfg.tls.ca)
    if vocab is None:
        with torch.no_grad():
            vocab = int(forward(torch.zeros(1, 1, dtype=torch.long, device=device)).shape[-1])
    relay = None
    if rank == 0:
        host, port = split_addr(cfg.listen)
        relay = LabelRelay(job_id=cfg.job_id, cluster=cfg.cluster, students=cfg.students,
                           pair=pair, ca=ca, bind=host, port=port, topk=cfg.topk,
                           values=Values(cfg.values), max_tokens=cfg.max_tokens,
                           heartbeat=cfg.dead_after / 4, dead_after=cfg.dead_after).start()
    addr = cfg.teachers[cfg.cluster]
    if relay is not None:  # its own relay, reached where it listens
        bound = split_addr(cfg.listen)[0]
        addr = f"{'127.0.0.1' if bound in ('', '0.0.0.0', '::') else bound}:{relay.port}"
    link = ServeLink(addr, client_context(pair, ca), job_id=cfg.job_id, cluster=cfg.cluster,
                     vocab=vocab, answer=answerer(forward, cfg, device))
    try:
        link.run(stop)
    finally:
        if relay is not None:
            relay.close()
        log.info("teacher %s: %d answers served", cfg.cluster, link.answered)
