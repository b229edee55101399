"""Catch-up transfers between relays: asking a peer for a round's average or a global state,
assembling its answer, and serving such requests from peers.

On a link (messages of :mod:`nebula_cli.relay.protocol.messages`): a
:class:`~nebula_cli.relay.protocol.messages.FetchRequest` (STATE_REQUEST {op: result, round,
req[, wait]} or {op: state, min_round, wait, req}), answered by a ResultAnswer or StateAnswer
header (RESULT / STATE frames {req, status: ok|none|busy, round, ...numel}) and then fp32
chunk frames {req, lo}. A state answer also says its lineage and whether it is theta_global
alone (parts 1) or theta_global then the outer momentum (parts 2). The size an answer
declares is checked against the size this relay syncs (times the parts of a state) before
anything is allocated; a peer has at most MAX_REQUESTS_PER_LINK requests served at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable

import torch

from nebula_cli.relay.net.framing import tensor_frames
from nebula_cli.relay.net.limits import MAX_REQUESTS_PER_LINK, Gate, Refusals
from nebula_cli.relay.net.link import LinkDown, PeerLink
from nebula_cli.relay.net.schema import encode
from nebula_cli.relay.net.wire import Frame, FrameType, WireError
from nebula_cli.relay.protocol.messages import (
    AnswerChunk,
    AnswerStatus,
    Fetched,
    FetchRequest,
    ResultAnswer,
    ResultAsk,
    StateAnswer,
)
from nebula_cli.relay.protocol.results import STATE_PARTS, Average, GlobalState

log = logging.getLogger("nebula.relay")

AnswerResult = Callable[[int, float, Callable[[], bool]], Average | None]
"""(round, longest wait, is the asker gone) -> the round's average held here, or None."""
AnswerState = Callable[[int, float], GlobalState | None]
"""(minimum round, longest wait) -> the newest global state held here, or None."""


Answer = ResultAnswer | StateAnswer


class Fetch:
    """A pending request to a peer for a result or a global state (assembled here)."""

    def __init__(self, req: int, link: PeerLink, max_numel: int) -> None:
        self.req = req
        self.link = link
        self.max_numel = max_numel
        self.head: Answer | None = None
        self.tensor: torch.Tensor | None = None
        self.got = 0
        self.error: str | None = None
        self.cv = threading.Condition()

    @property
    def complete(self) -> bool:
        if self.head is None:
            return False
        return self.tensor is None or self.got >= self.tensor.numel()

    def on_head(self, head: Answer) -> None:
        """The answer's header; WireError (the link closes) if it comes twice or declares
        more than ``max_numel`` elements."""
        with self.cv:
            if self.head is not None:
                raise WireError(f"a second answer to request {self.req}")
            if head.status == AnswerStatus.OK:
                if head.numel > self.max_numel:
                    raise WireError(f"answer to request {self.req} declares {head.numel} "
                                    f"elements; this relay syncs {self.max_numel}")
                self.tensor = torch.empty(head.numel, dtype=torch.float32)
            self.head = head
            self.cv.notify_all()

    def on_chunk(self, chunk: AnswerChunk) -> None:
        """One chunk of the answer's tensor; WireError if it is not the next one, or too
        much."""
        with self.cv:
            lo = chunk.lo
            if self.tensor is None or lo != self.got or len(chunk.payload) % 4:
                raise WireError(f"unexpected chunk at {lo} ({len(chunk.payload)} bytes) for "
                                f"request {self.req}")
            n = len(chunk.payload) // 4
            if self.got + n > self.tensor.numel():
                raise WireError(f"too much data for request {self.req}")
            self.tensor[lo : lo + n].copy_(torch.frombuffer(chunk.payload, dtype=torch.float32))
            self.got += n
            self.cv.notify_all()

    def fail(self, reason: str) -> None:
        with self.cv:
            self.error = reason
            self.cv.notify_all()

    def wait(self, timeout: float) -> bool:
        with self.cv:
            self.cv.wait_for(lambda: self.complete or self.error is not None, timeout)
            return self.complete


class Fetcher:
    """Requests to peers (``request``) and answers to theirs (``serve``)."""

    def __init__(self, *, sync_numel: Callable[[], int | None], chunk_elems: int,
                 answer_result: AnswerResult, answer_state: AnswerState, max_wait: float,
                 refusals: Refusals) -> None:
        self._sync_numel = sync_numel
        self._chunk = chunk_elems
        self._answer_result, self._answer_state = answer_result, answer_state
        self.max_wait = max_wait
        self._refusals = refusals
        self._pending: dict[int, Fetch] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._serving = Gate(MAX_REQUESTS_PER_LINK * 64, MAX_REQUESTS_PER_LINK)

    # ------------------------------------------------------------------ asking

    def request(self, link: PeerLink, ask: FetchRequest, timeout: float
                ) -> Average | GlobalState | None:
        """Ask ``link``'s peer; what it answered (of this relay's sync size), or None."""
        cap = self._sync_numel()
        if cap is None:
            return None  # nothing to hold it against: this cluster's workers never registered
        result = ask.what == Fetched.RESULT
        with self._lock:
            fetch = Fetch(next(self._ids), link, cap if result else cap * max(STATE_PARTS))
            self._pending[fetch.req] = fetch
        try:
            link.send(Frame(FrameType.STATE_REQUEST,
                            encode(dataclasses.replace(ask, req=fetch.req))))
            if not fetch.wait(timeout) or fetch.tensor is None or fetch.head is None:
                return None
            head, got = fetch.head, fetch.tensor.numel()
            if head.status != AnswerStatus.OK:
                return None
            if isinstance(head, ResultAnswer) and result and got == cap:
                return Average(head.round, list(head.present), list(head.rejected),
                               fetch.tensor, head.codec)
            if isinstance(head, StateAnswer) and not result and got == cap * head.parts:
                return GlobalState(head.round, fetch.tensor, head.lineage, head.parts)
            return None
        except LinkDown:
            return None
        finally:
            with self._lock:
                self._pending.pop(fetch.req, None)

    def on_answer(self, msg: Answer | AnswerChunk) -> None:
        """A peer's answer (its header or a chunk; runs on its link's receiver thread)."""
        with self._lock:
            fetch = self._pending.get(msg.req)
        if fetch is None:
            return  # an answer nobody waits for any more
        if isinstance(msg, AnswerChunk):
            fetch.on_chunk(msg)
        else:
            fetch.on_head(msg)

    def link_down(self, link: PeerLink) -> None:
        with self._lock:
            pending = [f for f in self._pending.values() if f.link is link]
        for f in pending:
            f.fail(f"link to {link.cluster} down")

    # ------------------------------------------------------------------ serving

    def serve(self, link: PeerLink, ask: FetchRequest) -> None:
        """Answer a peer's request on a thread of its own (at most a few per peer)."""
        if not self._serving.enter(link.cluster):
            self._refusals.refuse("request", f"{link.cluster} ({link.addr})",
                                  f"more than {MAX_REQUESTS_PER_LINK} requests at once")
            busy = (ResultAnswer if ask.what == Fetched.RESULT else StateAnswer)(
                req=ask.req, status=AnswerStatus.BUSY)
            link.send(Frame(_ANSWER[ask.what], encode(busy)))
            return

        def run() -> None:
            try:
                self._serve(link, ask)
            finally:
                self._serving.leave(link.cluster)

        threading.Thread(target=run, name=f"relay-serve-{ask.what.value}", daemon=True).start()

    def _serve(self, link: PeerLink, ask: FetchRequest) -> None:
        req = ask.req
        # chunks the peer accepts (limits.chunk_payload_cap: at most the synced size each),
        # also for a state of two parts (theta and the outer momentum)
        chunk = min(self._chunk, self._sync_numel() or self._chunk)
        none = AnswerStatus.NONE
        try:
            frames: list[Frame]
            if isinstance(ask, ResultAsk):
                wait = min(self.max_wait if ask.wait is None else ask.wait, self.max_wait)
                avg = self._answer_result(ask.round, wait, lambda: link.closed)
                frames = [Frame(FrameType.RESULT, encode(ResultAnswer(req=req, status=none)))] \
                    if avg is None else tensor_frames(FrameType.RESULT, encode(ResultAnswer(
                        req=req, status=AnswerStatus.OK, round=avg.round_id,
                        present=tuple(avg.present), rejected=tuple(avg.rejected),
                        codec=avg.codec, numel=avg.tensor.numel())), avg.tensor, chunk)
            else:
                wait = min(0.0 if ask.wait is None else ask.wait, self.max_wait)
                st = self._answer_state(ask.min_round, wait)
                frames = [Frame(FrameType.STATE, encode(StateAnswer(req=req, status=none)))] \
                    if st is None else tensor_frames(FrameType.STATE, encode(StateAnswer(
                        req=req, status=AnswerStatus.OK, round=st.round_id, lineage=st.lineage,
                        parts=st.parts, numel=st.tensor.numel())), st.tensor, chunk)
            for i, f in enumerate(frames):
                if i:
                    f.meta["req"] = req
                link.send(f, bulk=True)
        except LinkDown:
            pass


_ANSWER = {Fetched.RESULT: FrameType.RESULT, Fetched.STATE: FrameType.STATE}
"""The frame type of the answer to each kind of request."""
