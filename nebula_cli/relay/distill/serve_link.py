"""`ServeLink`: a teacher's serving rank on its cluster's label relay: it takes asks (token
ids, packed: `idpack`) and answers each with its sparse soft labels, computed by the caller's
``answer``; it dials again while the relay is away, until told to stop."""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable

import numpy as np

from nebula_cli.relay.distill.dial import LabelRefused, dial
from nebula_cli.relay.distill.idpack import unpack_ids
from nebula_cli.relay.distill.link import LabelLink
from nebula_cli.relay.distill.messages import LabelAnswer, LabelAsk, Side, max_ask_bytes
from nebula_cli.relay.distill.sparse import SparseLabels, Values, encode
from nebula_cli.relay.net.wire import Frame, FrameType, WireError

log = logging.getLogger("nebula.relay.distill")

RETRY_S = 0.2
"""Seconds between tries to reach the label relay."""
STOP_POLL_S = 0.1
"""How often a serving link looks whether it should stop."""


class ServeLink:
    """Answers the asks of the label relay at ``addr`` with ``answer(token_ids) ->
    SparseLabels`` (token_ids: int64 (sequences, width); the labels of every position, row
    by row, their ids over ``vocab`` tokens), until ``stop``."""

    def __init__(self, addr: str, ctx: ssl.SSLContext, *, job_id: str, cluster: str,
                 vocab: int, answer: Callable[[np.ndarray], SparseLabels],
                 timeout: float = 10.0) -> None:
        self.addr, self.ctx, self.job_id, self.cluster = addr, ctx, job_id, cluster
        self.vocab, self.answer, self.timeout = vocab, answer, timeout
        self.answered = 0
        self.connected = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (reconnecting while the relay is away)."""
        while not stop.is_set():
            try:
                link, welcome = dial(self.addr, self.ctx, job_id=self.job_id,
                                     cluster=self.cluster, side=Side.SERVER,
                                     max_payload=1 << 30, timeout=self.timeout)
            except LabelRefused as exc:
                log.debug("%s", exc)
                stop.wait(RETRY_S)
                continue
            link.max_payload = max_ask_bytes(welcome.max_tokens)
            self.connected.set()
            try:
                self._serve(link, welcome.values, welcome.max_tokens, stop)
            except (WireError, OSError) as exc:
                if not stop.is_set():
                    log.warning("label relay %s lost: %s; dialling again", self.addr, exc)
            finally:
                self.connected.clear()
                link.close()
            if not stop.is_set():
                time.sleep(RETRY_S)

    def _serve(self, link: LabelLink, values: Values, max_tokens: int,
               stop: threading.Event) -> None:
        beat = threading.Event()
        threading.Thread(target=self._beat, args=(link, beat, stop), daemon=True).start()
        try:
            while True:
                frame = link.recv()
                if frame.type is FrameType.BYE:
                    return
                if frame.type is not FrameType.LABELS_ASK:
                    raise WireError(f"the label relay sent {frame.type.name}")
                ask = LabelAsk.from_frame(frame, max_tokens)
                tokens = unpack_ids(frame.payload, ask.tokens, ask.bits).reshape(-1, ask.width)
                labels = self.answer(tokens)
                if labels.rows != ask.tokens:
                    raise ValueError(f"answer gave {labels.rows} rows for {ask.tokens} tokens")
                payload = encode(labels, self.vocab, values)
                out = LabelAnswer(seq=ask.seq, rows=labels.rows, k=labels.k, vocab=self.vocab,
                                  values=values,
                                  teacher=self.cluster)
                if not link.send(out.to_frame(payload)):
                    raise WireError("could not send an answer")
                self.answered += 1
        finally:
            beat.set()

    @staticmethod
    def _beat(link: LabelLink, done: threading.Event, stop: threading.Event) -> None:
        """A heartbeat every second, also while a long answer is computed (the relay ends
        silent links); the link ended once ``stop`` is set."""
        ticks = 0
        while not done.wait(STOP_POLL_S):
            if stop.is_set():
                link.close()
                return
            ticks += 1
            if ticks % round(1.0 / STOP_POLL_S) == 0:
                link.send(Frame(FrameType.HEARTBEAT))
