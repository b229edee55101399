"""A stand-in teacher for the soft-label service's tests: a fixed function from a token id to
its top-k (the next ids and falling log-probabilities), served by a real `ServeLink`, in this
process (`serving`) or as its own process (``python -m helpers.label_teacher``, so that a
test can SIGKILL it); and a model's teacher through the whole serving API (`serving_teacher`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import ssl
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from nebula_cli.config.distill_config import DistillConfig
from nebula_cli.config.distill_spec import DistillSpec
from nebula_cli.config.relay_config import TlsFiles
from nebula_cli.pki import CertPair, client_context
from nebula_cli.pki.certs import issue_job_pki
from nebula_cli.relay.distill.label_client import LabelClient
from nebula_cli.relay.distill.label_relay import LabelRelay
from nebula_cli.relay.distill.serve_link import ServeLink
from nebula_cli.relay.distill.sparse import SparseLabels, Values
from nebula_cli.relay.distill.student_links import max_asks
from nebula_cli.runtime.distill import serve

VOCAB = 5000
K = 4
JOB = "job-distill"
CONTEXT = 512
"""The stand-in teacher's context (positions)."""
LOOKAHEAD = DistillSpec().lookahead
STUDENT_SLOTS = {"cloud": 2}
"""The student clusters and their slots (hosts s1, s2)."""


def job_pki(root: Path) -> Path:
    """The job's certificates: teachers lab (t1, t2) and lab2 (u1), student cloud (s1, s2),
    outsider other (o1)."""
    issue_job_pki(JOB, {"lab": ["t1", "t2"], "lab2": ["u1"], "cloud": ["s1", "s2"],
                        "other": ["o1"]}, root, valid_for=dt.timedelta(days=1))
    return root


def worker_ctx(pki: Path, cluster: str, host: str) -> ssl.SSLContext:
    pair = CertPair(pki / cluster / f"worker-{host}.pem", pki / cluster / f"worker-{host}.key")
    return client_context(pair, pki / "ca.pem")


def distill_cfg(pki: Path, cluster: str, host: str, *, teachers: dict[str, str],
                listen: str = "", **kw: object) -> DistillConfig:
    """A distill.json as the plan writes it for `labels: topk` (the top K, fp16 values) at
    the spec's other defaults, ``kw`` replaced."""
    d = DistillSpec()
    fields: dict[str, object] = dict(
        job_id=JOB, cluster=cluster, teacher=bool(listen), listen=listen, teachers=teachers,
        students=dict(STUDENT_SLOTS), tls=TlsFiles(str(pki / "ca.pem"),
                                         str(pki / cluster / f"worker-{host}.pem"),
                                         str(pki / cluster / f"worker-{host}.key")),
        topk=K, temperature=d.temperature, alpha=d.alpha, lookahead=d.lookahead,
        when_no_teacher=d.when_no_teacher, values="fp16", max_tokens=d.max_tokens, vocab=d.vocab,
        wait_s=d.wait_s, dead_after=1.0, model=None, hub=False, batch_tokens=None)
    return DistillConfig(**(fields | kw))  # type: ignore[arg-type]


def label_relay(pki: Path, cluster: str = "lab", **kw: object) -> LabelRelay:
    """A started label relay of `cluster` on loopback (its relay certificate)."""
    args: dict[str, object] = dict(
        job_id=JOB, cluster=cluster, students=dict(STUDENT_SLOTS),
        pair=CertPair(pki / cluster / "relay.pem", pki / cluster / "relay.key"),
        ca=pki / "ca.pem", bind="127.0.0.1", port=0, topk=K, values=Values.FP16,
        max_tokens=1024, vocab=VOCAB, context=CONTEXT, max_asks=max_asks(LOOKAHEAD),
        heartbeat=0.2, dead_after=1.0)
    return LabelRelay(**(args | kw)).start()  # type: ignore[arg-type]


def label_client(pki: Path, teachers: dict[str, str], cluster: str = "cloud",
                 host: str = "s1", max_tokens: int = 1024, rank: int = 0) -> LabelClient:
    return LabelClient(teachers, worker_ctx(pki, cluster, host), job_id=JOB,
                       max_tokens=max_tokens, topk=K, dead_after=1.0, rank=rank).start()


def answer(tokens: np.ndarray) -> SparseLabels:
    """Token t's labels: ids t+1 .. t+K (mod VOCAB), log-probabilities -0.5, -1.5, ..."""
    ids = (tokens.reshape(-1)[:, None] + np.arange(1, K + 1)) % VOCAB
    logp = np.broadcast_to(-0.5 - np.arange(K, dtype=np.float32), ids.shape).copy()
    return SparseLabels(ids, logp)


def serve_link(addr: str, pki: Path, cluster: str, host: str, job_id: str,
               delay_s: float = 0.0,
               answer_with: Callable[[np.ndarray], SparseLabels] | None = None) -> ServeLink:
    """A serving link of the stand-in teacher (``answer_with``: another teacher's answers)."""
    base = answer_with or answer
    slow = base if not delay_s else (lambda t: (threading.Event().wait(delay_s), base(t))[1])
    return ServeLink(addr, worker_ctx(pki, cluster, host), job_id=job_id,
                     cluster=cluster, vocab=VOCAB, context=CONTEXT, answer=slow)


@contextlib.contextmanager
def serving(link: ServeLink) -> Iterator[ServeLink]:
    """`link` served in a thread while the block runs."""
    stop = threading.Event()
    t = threading.Thread(target=link.run, args=(stop,), daemon=True)
    t.start()
    try:
        yield link
    finally:
        stop.set()
        t.join(timeout=10)
        assert not t.is_alive()


@contextlib.contextmanager
def serving_teacher(pki: Path, port: int, forward: Callable[[torch.Tensor], torch.Tensor],
                    **kw: object) -> Iterator[None]:
    """`runtime.distill.serve(forward)` as teacher cluster lab's host t1, in a thread, its label
    relay on 127.0.0.1:``port``, while the block runs (``kw``: its distill.json's fields)."""
    cfg = distill_cfg(pki, "lab", "t1", teachers={"lab": f"127.0.0.1:{port}"},
                      listen=f"127.0.0.1:{port}", **kw)
    stop = threading.Event()
    t = threading.Thread(target=serve, args=(forward,), kwargs=dict(config=cfg, rank=0, stop=stop),
                         daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=15)
        assert not t.is_alive()


if __name__ == "__main__":  # addr pki cluster host job_id delay_s
    addr, pki, cluster, host, job_id, delay = sys.argv[1:7]
    serve_link(addr, Path(pki), cluster, host, job_id, float(delay)).run(threading.Event())


def peaked_teacher(model: torch.nn.Module) -> torch.nn.Module:
    """A randomly initialised GPT-2 made confident: its (tied) token embeddings scaled, so its
    next-token distributions are peaked, as a trained teacher's are, and there is something to
    distil (a random teacher's are nearly uniform)."""
    with torch.no_grad():
        model.transformer.wte.weight.mul_(30.0)
    return model
