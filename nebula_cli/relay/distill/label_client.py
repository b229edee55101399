"""`LabelClient`: a student's side of the soft-label service. It keeps a link to every teacher
cluster's label relay (dialled again while one is away), spreads its asks over the links alive
(the least loaded first), and asks again, of another teacher, whatever a link that ended had
not answered: an ask is answered once, whichever teacher answers it. ``take`` waits for one
answer; ``live`` says which teachers answer now. A link holds at most the asks its WELCOME
allows outstanding (more wait here); an ask with an id or a width beyond a linked teacher's
vocabulary or context is refused here (`AskRefused`), and one a teacher could not answer
raises `LabelsFailed` from ``take``, saying why.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass

import numpy as np

from nebula_cli.relay.distill.dial import LabelRefused, RelayRefused, dial
from nebula_cli.relay.distill.idpack import bits_needed, pack_ids, unpack_ids
from nebula_cli.relay.distill.link import LabelLink, keep_alive
from nebula_cli.relay.distill.messages import (
    LabelAnswer,
    LabelAsk,
    LabelFailed,
    LabelHello,
    LabelRefusal,
    LabelWelcome,
    Side,
    max_answer_bytes,
)
from nebula_cli.relay.distill.sparse import (
    SparseLabels,
    Values,
    decode,
    next_tokens,
    payload_nbytes,
)
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
    vocab: int
    """The teacher's vocabulary (every id of the labels is below it)."""
    scored: bool = False
    """Whether the labels score the asked tokens themselves (``token`` values, on-policy)
    rather than give the teacher's own."""


class AskRefused(ValueError):
    """An ask a linked teacher cannot run (an id or a width beyond its vocabulary or context),
    refused before it is sent."""


class LabelsFailed(Exception):
    """A teacher answered an ask with why it gives no labels for it."""

    def __init__(self, seq: int, teacher: str, reason: str) -> None:
        super().__init__(f"teacher {teacher} gives no soft labels for ask {seq}: {reason}")
        self.seq, self.teacher, self.reason = seq, teacher, reason


@dataclass
class _Asked:
    ask: LabelAsk
    payload: bytes
    sent: float
    link: str | None = None


class LabelClient:
    """Asks the teachers ``teachers`` (cluster name -> host:port) for soft labels."""

    def __init__(self, teachers: dict[str, str], ctx: ssl.SSLContext, *, job_id: str,
                 max_tokens: int, topk: int, dead_after: float, rank: int = 0,
                 timeout: float = 10.0) -> None:
        """``rank``: this process's rank in its cluster (a rank's new link to a teacher
        replaces its older one there)."""
        if not teachers:
            raise ValueError("a label client needs at least one teacher")
        self.teachers, self.ctx, self.job_id, self.rank = dict(teachers), ctx, job_id, rank
        self.max_tokens, self.topk = max_tokens, topk
        self.dead_after, self.timeout = dead_after, timeout
        self._cond = threading.Condition()
        self._asked: dict[int, _Asked] = {}
        self._answers: dict[int, Answer] = {}
        self._failed: dict[int, LabelsFailed] = {}
        self._links: dict[str, LabelLink] = {}
        self._welcomes: dict[str, LabelWelcome] = {}
        """The WELCOME of each teacher linked now (or last)."""
        self._sent: dict[str, set[int]] = {}
        """The asks each link holds (sent, not answered or failed; forgotten ones too)."""
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
        out of range is a `WireError` naming it; an id or a width beyond a linked teacher's
        vocabulary or context, an `AskRefused` naming both."""
        width = int(tokens.shape[-1]) if tokens.ndim else 1
        if not 1 <= tokens.size <= self.max_tokens:
            raise ValueError(f"an ask of {tokens.size} tokens; distill.max_tokens is "
                             f"{self.max_tokens}")
        bits = bits_needed(tokens)
        with self._cond:
            welcomes = list(self._welcomes.values())
        top = int(tokens.max())
        for w in welcomes:
            if top >= w.vocab or width > w.context:
                raise AskRefused(
                    f"a batch with token id {top} in sequences of {width}; teacher "
                    f"{w.cluster}'s vocabulary is {w.vocab} tokens and its context "
                    f"{w.context}: the student's tokenizer and sequence length must fit the "
                    "teacher's")
        asked = _Asked(LabelAsk(seq=seq, tokens=int(tokens.size), width=width, bits=bits),
                       pack_ids(tokens, bits),
                       time.monotonic())
        with self._cond:
            if seq in self._asked or seq in self._answers or seq in self._failed:
                raise ValueError(f"ask {seq} was already made")
            self._asked[seq] = asked
        self._assign()

    def take(self, seq: int, timeout: float | None) -> Answer | None:
        """The answer to ask ``seq`` (removed from the client), or None after ``timeout``
        seconds without it; `LabelsFailed` when a teacher answered why it gives none."""
        with self._cond:
            if seq not in self._asked and seq not in self._answers and seq not in self._failed:
                raise KeyError(f"ask {seq} was never made")
            self._cond.wait_for(lambda: seq in self._answers or seq in self._failed
                                or self._stop.is_set(), timeout)
            failed = self._failed.pop(seq, None)
            if failed is not None:
                self._asked.pop(seq, None)
                raise failed
            out = self._answers.pop(seq, None)
            if out is not None:
                self._asked.pop(seq, None)
            return out

    def forget(self, seq: int) -> None:
        """Give up ask ``seq`` (trained without its labels): an answer that comes is dropped."""
        with self._cond:
            self._asked.pop(seq, None)
            self._answers.pop(seq, None)
            self._failed.pop(seq, None)

    def outstanding(self) -> int:
        with self._cond:
            return len(self._asked)

    def _assign(self) -> None:
        """Send every ask no live link holds to the least loaded live link with room (the
        asks its WELCOME allows outstanding; the others wait for answers)."""
        sends: list[tuple[LabelLink, _Asked]] = []
        with self._cond:
            for seq, a in self._asked.items():
                room = [n for n in self._links
                        if len(self._sent[n]) < self._welcomes[n].max_asks]
                if not room:
                    break
                if a.link is None and seq not in self._answers:
                    name = min(room, key=lambda n: len(self._sent[n]))
                    self._sent[name].add(seq)
                    a.link, a.sent = name, time.monotonic()
                    sends.append((self._links[name], a))
        for link, a in sends:  # a failed send ends the link: its asks go elsewhere
            link.send(a.ask.to_frame(a.payload))

    # ------------------------------------------------------------------ links

    def _keep_linked(self, name: str, addr: str) -> None:
        cap = max_answer_bytes(self.max_tokens, self.topk)
        hello = LabelHello(job=self.job_id, side=Side.STUDENT, rank=self.rank)
        said = None
        while not self._stop.is_set():
            try:
                link, welcome = dial(addr, self.ctx, hello=hello, cluster=name,
                                     max_payload=cap, timeout=self.timeout)
            except LabelRefused as exc:
                if isinstance(exc, RelayRefused) and str(exc) != said:
                    log.warning("soft labels: %s", exc)  # once while it says the same
                    said = str(exc)
                else:
                    log.debug("%s", exc)
                self._stop.wait(RETRY_S)
                continue
            said = None
            with self._cond:
                self._links[name], self._welcomes[name] = link, welcome
                self._sent[name] = set()
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
                    self._sent.pop(name, None)
                    lost = [a for a in self._asked.values() if a.link == name]
                    for a in lost:
                        a.link = None
                    self.resent += len(lost)
                self._assign()  # what it held, to the teachers left
            self._stop.wait(RETRY_S)

    def _read(self, name: str, link: LabelLink) -> None:
        while True:
            frame = link.recv()
            if frame.type is FrameType.ERROR:  # the relay ends the link, saying why
                raise WireError(f"teacher {name} ended the link: "
                                f"{schema.decode(LabelRefusal, frame.meta).reason}")
            if frame.type is FrameType.LABELS_FAILED:
                self._ask_failed(name, schema.decode(LabelFailed, frame.meta))
                continue
            if frame.type is not FrameType.LABELS:
                raise WireError(f"teacher {name} sent {frame.type.name}")
            ans = schema.decode(LabelAnswer, frame.meta, limits={"max_tokens": self.max_tokens})
            if len(frame.payload) != payload_nbytes(ans.rows, ans.k, ans.vocab, ans.values):
                raise WireError(f"LABELS of {ans.rows} x {ans.k} in {len(frame.payload)} bytes")
            with self._cond:
                vocab = self._welcomes[name].vocab
                self._sent[name].discard(ans.seq)
            if ans.vocab != vocab:
                raise WireError(f"teacher {name} answered over a vocabulary of {ans.vocab}; "
                                f"its WELCOME said {vocab}")
            self._assign()  # the link has room again
            with self._cond:
                asked = self._asked.get(ans.seq)
                if asked is None or ans.seq in self._answers:
                    continue  # answered already (by a teacher that was taken for gone)
                if ans.rows != asked.ask.tokens:
                    raise WireError(f"{ans.rows} rows of labels for {asked.ask.tokens} tokens")
            scored = None
            if ans.values is Values.TOKEN:  # the ids it scored: what was asked, one on
                scored = next_tokens(unpack_ids(asked.payload, asked.ask.tokens,
                                                asked.ask.bits), asked.ask.width)
            labels = decode(frame.payload, ans.rows, ans.k, ans.vocab, ans.values, scored)
            with self._cond:
                if ans.seq in self._asked and ans.seq not in self._answers:
                    self._answers[ans.seq] = Answer(labels, ans.teacher or name,
                                                    len(frame.payload), len(asked.payload),
                                                    time.monotonic() - asked.sent, ans.vocab,
                                                    scored is not None)
                    self.answered += 1
                    self._cond.notify_all()

    def _ask_failed(self, name: str, failed: LabelFailed) -> None:
        """A teacher gives no labels for an ask: ``take`` says why (asking again would fail
        again, or end another serving rank)."""
        log.warning("soft labels: teacher %s gives none for ask %d: %s", name, failed.seq,
                    failed.reason)
        with self._cond:
            self._sent[name].discard(failed.seq)
            if failed.seq in self._asked and failed.seq not in self._answers:
                self._failed[failed.seq] = LabelsFailed(failed.seq, failed.teacher or name,
                                                        failed.reason)
                self._cond.notify_all()
        self._assign()


