"""`ServeLink`: a teacher's serving rank on its cluster's label relay: it takes asks (token
ids, packed: `idpack`) and answers each with its sparse soft labels, computed by the caller's
``answer``; it dials again while the relay is away, until told to stop. An ask it cannot
run (an id beyond its vocabulary, sequences wider than its context: checked before the model
sees them) or that its model fails on is answered with why (``LABELS_FAILED``), not with the
end of the rank."""

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
from nebula_cli.relay.distill.messages import (
    LabelAnswer,
    LabelAsk,
    LabelFailed,
    LabelHello,
    Side,
    max_ask_bytes,
)
from nebula_cli.relay.distill.sparse import SparseLabels, Values, encode
from nebula_cli.relay.net.wire import Frame, FrameType, WireError

log = logging.getLogger("nebula.relay.distill")

RETRY_S = 0.2
"""Seconds between tries to reach the label relay."""
STOP_POLL_S = 0.1
"""How often a serving link looks whether it should stop."""


class AskFailed(Exception):
    """An ask a serving rank does not answer, and why (sent to its student)."""


class ServeLink:
    """Answers the asks of the label relay at ``addr`` with ``answer(token_ids) ->
    SparseLabels`` (token_ids: int64 (sequences, width); the labels of every position, row
    by row, their ids over ``vocab`` tokens; sequences of at most ``context``), until
    ``stop``."""

    def __init__(self, addr: str, ctx: ssl.SSLContext, *, job_id: str, cluster: str,
                 vocab: int, context: int, answer: Callable[[np.ndarray], SparseLabels],
                 timeout: float = 10.0) -> None:
        self.addr, self.ctx, self.job_id, self.cluster = addr, ctx, job_id, cluster
        self.vocab, self.context, self.answer, self.timeout = vocab, context, answer, timeout
        self.answered = self.failed = 0
        self.connected = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (reconnecting while the relay is away)."""
        while not stop.is_set():
            try:
                hello = LabelHello(job=self.job_id, side=Side.SERVER, vocab=self.vocab,
                                   context=self.context)
                link, welcome = dial(self.addr, self.ctx, hello=hello, cluster=self.cluster,
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
                try:
                    out = self._answer(ask, frame.payload, values)
                    self.answered += 1
                except AskFailed as exc:
                    log.warning("teacher %s: ask %d fails: %s", self.cluster, ask.seq, exc)
                    out = LabelFailed(seq=ask.seq, reason=str(exc),
                                      teacher=self.cluster).to_frame()
                    self.failed += 1
                if not link.send(out):
                    raise WireError("could not send an answer")
        finally:
            beat.set()

    def _answer(self, ask: LabelAsk, payload: bytearray, values: Values) -> Frame:
        """The answer's frame; AskFailed: why there is none (this ask's alone)."""
        why = ask.beyond(payload, self.vocab, self.context)
        if why is not None:
            raise AskFailed(why)
        tokens = unpack_ids(payload, ask.tokens, ask.bits).reshape(-1, ask.width)
        try:
            labels = self.answer(tokens)
        except Exception as exc:  # the model's, on these tokens: the rank serves on
            raise AskFailed(f"the teacher's model failed on it: {type(exc).__name__}: "
                            f"{exc}") from exc
        if labels.rows != ask.tokens:
            raise AskFailed(f"the teacher's answer gave {labels.rows} rows for {ask.tokens} "
                            "tokens")
        out = LabelAnswer(seq=ask.seq, rows=labels.rows, k=labels.k, vocab=self.vocab,
                          values=values, teacher=self.cluster)
        return out.to_frame(encode(labels, self.vocab, values))

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
