"""`LabelClient`: a student's side of the soft-label service. It keeps a link to every teacher
cluster's label relay (dialled again while one is away), spreads its asks over the links alive
(the least loaded first), and asks again, of another teacher, whatever a link that ended had
not answered: an ask is answered once, whichever teacher answers it. ``take`` waits for one
answer; ``live`` says which teachers answer now.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass

import numpy as np

from nebula_cli.relay.distill.dial import LabelRefused, dial
from nebula_cli.relay.distill.idpack import bits_needed, pack_ids
from nebula_cli.relay.distill.link import LabelLink, keep_alive
from nebula_cli.relay.distill.messages import (
    LabelAnswer,
    LabelAsk,
    Side,
    max_answer_bytes,
)
from nebula_cli.relay.distill.sparse import SparseLabels, decode, payload_nbytes
from nebula_cli.relay.net import schema
from nebula_cli.relay.net.wire import FrameType, WireError

log = logging.getLogger("nebula.relay.distill")

RETRY_S = 0.5
"""Seconds between tries to reach a teacher's label relay."""


@dataclass(frozen=True)
class Answer:
    """Soft labels for one ask, and what they cost."""

    labels: SparseLabels
    teacher: str
    wire_bytes: int
    """Bytes of the answer's frame payload (what crossed the WAN for it, TLS aside)."""
    ask_bytes: int
    """Bytes of the ask's frame payload (its token ids, packed), as sent once."""
    latency_s: float
    """Seconds from the ask (its latest sending) to the answer."""


@dataclass
class _Asked:
    ask: LabelAsk
    payload: bytes
    sent: float
    link: str | None = None


class LabelClient:
    """Asks the teachers ``teachers`` (cluster name -> host:port) for soft labels."""

    def __init__(self, teachers: dict[str, str], ctx: ssl.SSLContext, *, job_id: str,
                 max_tokens: int, topk: int, dead_after: float, timeout: float = 10.0) -> None:
        if not teachers:
            raise ValueError("a label client needs at least one teacher")
        self.teachers, self.ctx, self.job_id = dict(teachers), ctx, job_id
        self.max_tokens, self.topk = max_tokens, topk
        self.dead_after, self.timeout = dead_after, timeout
        self._cond = threading.Condition()
        self._asked: dict[int, _Asked] = {}
        self._answers: dict[int, Answer] = {}
        self._links: dict[str, LabelLink] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.answered = self.resent = 0

    def start(self) -> LabelClient:
        for name, addr in self.teachers.items():
            t = threading.Thread(target=self._keep_linked, args=(name, addr), daemon=True,
                                 name=f"labels-{name}")
            t.start()
            self._threads.append(t)
        beat = threading.Thread(target=keep_alive, daemon=True, name="labels-alive",
                                args=(self._live_links, self.dead_after / 4, self.dead_after,
                                      self._stop))
        beat.start()
        self._threads.append(beat)
        return self

    def close(self) -> None:
        self._stop.set()
        for link in self._live_links():
            link.close()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)

    def live(self) -> list[str]:
        """The teachers linked now, in the spec's order."""
        with self._cond:
            return [n for n in self.teachers if n in self._links]

    def wait_live(self, timeout: float) -> bool:
        """Whether some teacher is linked within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._links) or self._stop.is_set(),
                                       timeout) and bool(self._links)

    def _live_links(self) -> list[LabelLink]:
        with self._cond:
            return list(self._links.values())

    # ------------------------------------------------------------------ asks and answers

    def ask(self, seq: int, tokens: np.ndarray) -> None:
        """Ask for the soft labels of ``tokens`` (integer ids 0 .. 2**24 - 1, sent in the bits
        the largest needs; sequences: (batch, width), or one sequence), named ``seq``. An id
        out of range is a `WireError` naming it."""
        width = int(tokens.shape[-1]) if tokens.ndim else 1
        if not 1 <= tokens.size <= self.max_tokens:
            raise ValueError(f"an ask of {tokens.size} tokens; distill.max_tokens is "
                             f"{self.max_tokens}")
        bits = bits_needed(tokens)
        asked = _Asked(LabelAsk(seq=seq, tokens=int(tokens.size), width=width, bits=bits),
                       pack_ids(tokens, bits),
                       time.monotonic())
        with self._cond:
            if seq in self._asked or seq in self._answers:
                raise ValueError(f"ask {seq} was already made")
            self._asked[seq] = asked
        self._assign()

    def take(self, seq: int, timeout: float | None) -> Answer | None:
        """The answer to ask ``seq`` (removed from the client), or None after ``timeout``
        seconds without it."""
        with self._cond:
            if seq not in self._asked and seq not in self._answers:
                raise KeyError(f"ask {seq} was never made")
            self._cond.wait_for(lambda: seq in self._answers or self._stop.is_set(), timeout)
            out = self._answers.pop(seq, None)
            if out is not None:
                self._asked.pop(seq, None)
            return out

    def forget(self, seq: int) -> None:
        """Give up ask ``seq`` (trained without its labels): an answer that comes is dropped."""
        with self._cond:
            self._asked.pop(seq, None)
            self._answers.pop(seq, None)

    def outstanding(self) -> int:
        with self._cond:
            return len(self._asked)

    def _assign(self) -> None:
        """Send every ask no live link holds to the least loaded live link."""
        sends: list[tuple[LabelLink, _Asked]] = []
        with self._cond:
            if not self._links:
                return
            load = {n: 0 for n in self._links}
            for a in self._asked.values():
                if a.link in load:
                    load[a.link] += 1
            for seq, a in self._asked.items():
                if a.link is None and seq not in self._answers:
                    name = min(load, key=load.__getitem__)
                    load[name] += 1
                    a.link, a.sent = name, time.monotonic()
                    sends.append((self._links[name], a))
        for link, a in sends:  # a failed send ends the link: its asks go elsewhere
            link.send(a.ask.to_frame(a.payload))

    # ------------------------------------------------------------------ links

    def _keep_linked(self, name: str, addr: str) -> None:
        cap = max_answer_bytes(self.max_tokens, self.topk)
        while not self._stop.is_set():
            try:
                link, _ = dial(addr, self.ctx, job_id=self.job_id, cluster=name,
                               side=Side.STUDENT, max_payload=cap, timeout=self.timeout)
            except LabelRefused as exc:
                log.debug("%s", exc)
                self._stop.wait(RETRY_S)
                continue
            with self._cond:
                self._links[name] = link
                self._cond.notify_all()
            log.info("soft labels: linked to teacher %s", link.peer)
            self._assign()
            try:
                self._read(name, link)
            except (WireError, OSError, ValueError) as exc:
                if not self._stop.is_set():
                    log.warning("soft labels: teacher %s lost: %s", name, exc)
            finally:
                link.close()
                with self._cond:
                    self._links.pop(name, None)
                    lost = [a for a in self._asked.values() if a.link == name]
                    for a in lost:
                        a.link = None
                    self.resent += len(lost)
                self._assign()  # what it held, to the teachers left
            self._stop.wait(RETRY_S)

    def _read(self, name: str, link: LabelLink) -> None:
        while True:
            frame = link.recv()
            if frame.type is not FrameType.LABELS:
                raise WireError(f"teacher {name} sent {frame.type.name}")
            ans = schema.decode(LabelAnswer, frame.meta, limits={"max_tokens": self.max_tokens})
            if len(frame.payload) != payload_nbytes(ans.rows, ans.k, ans.vocab, ans.values):
                raise WireError(f"LABELS of {ans.rows} x {ans.k} in {len(frame.payload)} bytes")
            with self._cond:
                asked = self._asked.get(ans.seq)
                if asked is None or ans.seq in self._answers:
                    continue  # answered already (by a teacher that was taken for gone)
                if ans.rows != asked.ask.tokens:
                    raise WireError(f"{ans.rows} rows of labels for {asked.ask.tokens} tokens")
            labels = decode(frame.payload, ans.rows, ans.k, ans.vocab, ans.values)
            with self._cond:
                if ans.seq in self._asked and ans.seq not in self._answers:
                    self._answers[ans.seq] = Answer(labels, ans.teacher or name,
                                                    len(frame.payload), len(asked.payload),
                                                    time.monotonic() - asked.sent)
                    self.answered += 1
                    self._cond.notify_all()


