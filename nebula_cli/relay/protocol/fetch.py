"""Catch-up transfers between relays: asking a peer for a round's average or a global state,
assembling its answer, and serving such requests from peers.

On a link: STATE_REQUEST {op: result, round, req[, wait]} or {op: state, min_round, wait, req},
answered by RESULT / STATE frames {req, status: ok|none|busy, round, ...numel} and then fp32
chunk frames {req, lo}. A state answer also says its lineage and whether it is theta_global
alone (parts 1) or theta_global then the outer momentum (parts 2). The size an answer
declares is checked against the size this relay syncs (times the parts of a state) before
anything is allocated; a peer has at most MAX_REQUESTS_PER_LINK requests served at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from nebula_cli.relay.net.framing import tensor_frames
from nebula_cli.relay.net.limits import MAX_REQUESTS_PER_LINK, Gate, Refusals
from nebula_cli.relay.net.link import LinkDown, PeerLink
from nebula_cli.relay.net.wire import Frame, FrameType, WireError
from nebula_cli.relay.protocol.lineage import UNKNOWN
from nebula_cli.relay.protocol.pacing import CODEC_CHARS
from nebula_cli.relay.protocol.results import STATE_PARTS, Average, GlobalState

log = logging.getLogger("nebula.relay")

AnswerResult = Callable[[int, float, Callable[[], bool]], Average | None]
"""(round, longest wait, is the asker gone) -> the round's average held here, or None."""
AnswerState = Callable[[int, float], GlobalState | None]
"""(minimum round, longest wait) -> the newest global state held here, or None."""


class Fetch:
    """A pending request to a peer for a result or a global state (assembled here)."""

    def __init__(self, req: int, link: PeerLink, max_numel: int) -> None:
        self.req = req
        self.link = link
        self.max_numel = max_numel
        self.meta: dict[str, Any] | None = None
        self.tensor: torch.Tensor | None = None
        self.got = 0
        self.error: str | None = None
        self.cv = threading.Condition()

    @property
    def complete(self) -> bool:
        if self.meta is None:
            return False
        return self.tensor is None or self.got >= self.tensor.numel()

    def on_frame(self, frame: Frame) -> None:
        """One frame of the answer; WireError (the link closes) if it breaks the protocol or
        declares more than ``max_numel`` elements."""
        with self.cv:
            if self.meta is None:
                numel = frame.meta.get("numel")
                if frame.meta.get("status") == "ok":
                    if (not isinstance(numel, int) or isinstance(numel, bool)
                            or not 0 <= numel <= self.max_numel):
                        raise WireError(f"answer to request {self.req} declares {numel!r} "
                                        f"elements; this relay syncs {self.max_numel}")
                    self.tensor = torch.empty(numel, dtype=torch.float32)
                self.meta = frame.meta
            else:
                lo = frame.meta.get("lo")
                if self.tensor is None or lo != self.got or len(frame.payload) % 4:
                    raise WireError(f"unexpected chunk {frame.meta} for request {self.req}")
                n = len(frame.payload) // 4
                if self.got + n > self.tensor.numel():
                    raise WireError(f"too much data for request {self.req}")
                self.tensor[lo : lo + n].copy_(torch.frombuffer(frame.payload,
                                                                dtype=torch.float32))
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

    def request(self, link: PeerLink, meta: dict[str, Any], timeout: float
                ) -> Average | GlobalState | None:
        """Ask ``link``'s peer; what it answered (of this relay's sync size), or None."""
        cap = self._sync_numel()
        if cap is None:
            return None  # nothing to hold it against: this cluster's workers never registered
        with self._lock:
            limit = cap if meta["op"] == "result" else cap * max(STATE_PARTS)
            fetch = Fetch(next(self._ids), link, limit)
            self._pending[fetch.req] = fetch
        try:
            link.send(Frame(FrameType.STATE_REQUEST, {**meta, "req": fetch.req}))
            if not fetch.wait(timeout) or fetch.tensor is None or fetch.meta is None:
                return None
            m = fetch.meta
            parts = 1 if meta["op"] == "result" else m.get("parts", 1)
            if (m.get("status") != "ok" or parts not in STATE_PARTS
                    or fetch.tensor.numel() != cap * parts):
                return None
            if meta["op"] == "result":
                return Average(int(m["round"]), [str(c) for c in m.get("present", [])],
                               [str(c) for c in m.get("rejected", [])], fetch.tensor,
                               str(m.get("codec") or "")[:CODEC_CHARS])
            return GlobalState(int(m["round"]), fetch.tensor, str(m.get("lineage", UNKNOWN)),
                               parts)
        except (LinkDown, KeyError, TypeError, ValueError):
            return None
        finally:
            with self._lock:
                self._pending.pop(fetch.req, None)

    def on_answer(self, frame: Frame) -> None:
        """A RESULT or STATE frame from a peer (runs on its link's receiver thread)."""
        with self._lock:
            fetch = self._pending.get(frame.meta.get("req"))  # type: ignore[arg-type]
        if fetch is not None:  # else an answer nobody waits for any more
            fetch.on_frame(frame)

    def link_down(self, link: PeerLink) -> None:
        with self._lock:
            pending = [f for f in self._pending.values() if f.link is link]
        for f in pending:
            f.fail(f"link to {link.cluster} down")

    # ------------------------------------------------------------------ serving

    def serve(self, link: PeerLink, m: dict[str, Any]) -> None:
        """Answer a peer's STATE_REQUEST on a thread of its own (at most a few per peer)."""
        what = m.get("op")
        if what not in ("result", "state"):
            raise WireError(f"unknown STATE_REQUEST op {what!r}")
        if not self._serving.enter(link.cluster):
            self._refusals.refuse("request", f"{link.cluster} ({link.addr})",
                                  f"more than {MAX_REQUESTS_PER_LINK} requests at once")
            kind = FrameType.RESULT if what == "result" else FrameType.STATE
            link.send(Frame(kind, {"req": m.get("req"), "status": "busy"}))
            return

        def run() -> None:
            try:
                self._serve(link, m)
            finally:
                self._serving.leave(link.cluster)

        threading.Thread(target=run, name=f"relay-serve-{what}", daemon=True).start()

    def _serve(self, link: PeerLink, m: dict[str, Any]) -> None:
        req = m.get("req")
        # chunks the peer accepts (limits.chunk_payload_cap: at most the synced size each),
        # also for a state of two parts (theta and the outer momentum)
        chunk = min(self._chunk, self._sync_numel() or self._chunk)
        try:
            frames: list[Frame]
            if m["op"] == "result":
                wait = min(float(m.get("wait", self.max_wait)), self.max_wait)
                avg = self._answer_result(int(m["round"]), wait, lambda: link.closed)
                frames = [Frame(FrameType.RESULT, {"req": req, "status": "none"})] if avg is None \
                    else tensor_frames(FrameType.RESULT, {
                        "req": req, "status": "ok", "round": avg.round_id,
                        "present": avg.present, "rejected": avg.rejected, "codec": avg.codec},
                        avg.tensor, chunk)
            else:
                wait = min(float(m.get("wait", 0)), self.max_wait)
                st = self._answer_state(int(m.get("min_round", -1)), wait)
                frames = [Frame(FrameType.STATE, {"req": req, "status": "none"})] if st is None \
                    else tensor_frames(FrameType.STATE, {
                        "req": req, "status": "ok", "round": st.round_id,
                        "lineage": st.lineage, "parts": st.parts}, st.tensor, chunk)
            for i, f in enumerate(frames):
                if i:
                    f.meta["req"] = req
                link.send(f, bulk=True)
        except LinkDown:
            pass
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("bad request from %s: %s", link.cluster, exc)
