"""`LabelRelay`: a teacher cluster's soft-label service. Students' ranks (certificates of the
job's training clusters only) send asks (token ids); the teacher's own serving ranks (its
cluster's worker certificates) take them, at most ``window`` at a time each, and answer with
sparse soft labels, which the relay hands to the asker under the asker's number.

Nothing else crosses: a student sends token ids, a server sends labels; every frame is
bounded (asks by ``max_tokens``, answers by what their shape makes). What a student may hold is
bounded too (`StudentLinks`): links per student cluster, asks outstanding per link (one more
ends the link, with a refusal the student logs), tokens queued over all (beyond, an ask fails
at once). The teacher's vocabulary and context (``vocab``, ``context``: its model's, which
every serving rank's HELLO must say too) are in the WELCOME, and an ask with an id or a width
beyond them fails before it is queued (``LABELS_FAILED``, naming both), as does an ask a server
could not run (it says why): a failed ask is never asked again. An ask a server had not
answered when its link ended goes to another server, first in line, once (lost with a second
server, it fails); asks wait while no server is connected. Every link sends from its own
bounded queue (`LabelLink`): a student that stops reading holds up nobody else, and is ended
when one frame has waited ``dead_after`` seconds for it, as is a link silent that long
(heartbeats every ``heartbeat`` seconds keep a quiet one open). Connections wait in an
`Admission` until their TLS handshake and HELLO are done.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from nebula_cli.pki import CertPair, PeerRejected, server_context, wrap_server
from nebula_cli.relay.distill.link import LabelLink, keep_alive, queue_bound
from nebula_cli.relay.distill.messages import (
    PROTOCOL,
    LabelAnswer,
    LabelAsk,
    LabelFailed,
    LabelHello,
    LabelRefusal,
    LabelWelcome,
    Side,
    max_answer_bytes,
    max_ask_bytes,
)
from nebula_cli.relay.distill.sparse import Values, payload_nbytes
from nebula_cli.relay.distill.student_links import QUEUE_TOKENS, StudentLinks
from nebula_cli.relay.net.admission import Admission, first_bytes
from nebula_cli.relay.net.schema import decode
from nebula_cli.relay.net.wire import (
    Frame,
    FrameType,
    WireError,
    close_after_refusal,
    recv_small_frame,
    send_frame,
)

LOSSES = 2
"""Servers an ask may be lost with (their links ended while it ran) before it fails."""

log = logging.getLogger("nebula.relay.distill")

HELLO_BYTES = 4096
"""Most bytes of a HELLO read before the peer is known."""
HANDSHAKE_S = 10.0
"""Seconds from accept to a finished TLS handshake and HELLO."""


@dataclass
class _Ask:
    student: LabelLink
    ask: LabelAsk
    """As the student sent it (its ``seq``: the student's number)."""
    payload: bytes | bytearray
    """The packed token ids, forwarded as they came."""
    arrived: float = field(default_factory=time.monotonic)
    """When the student's ask reached the relay (its answer's latency counts from here)."""
    lost: int = 0
    """Servers whose link ended while they ran it."""


@dataclass
class _Server:
    link: LabelLink
    inflight: dict[int, _Ask] = field(default_factory=dict)


@dataclass(frozen=True)
class RelayCounts:
    """What the label relay did so far (for its log and status)."""

    asks: int
    answers: int
    pending: int
    """Asks waiting for a server with room (the queue)."""
    servers: int
    students: int
    refused: int
    tokens: int = 0
    """Tokens answered (rows of every answer)."""
    latency_s: float = 0.0
    """Seconds from each answered ask's arrival to its answer, summed over the answers."""
    ask_bytes: int = 0
    """Payload bytes of the students' asks (their packed token ids)."""
    failed: int = 0
    """Asks that got no labels (refused before queueing, or a server could not run them)."""


class LabelRelay:
    """The soft-label service of teacher cluster ``cluster`` (see the module's docstring)."""

    def __init__(self, *, job_id: str, cluster: str, students: Mapping[str, int],
                 pair: CertPair, ca: Path, bind: str, port: int, topk: int, values: Values,
                 max_tokens: int, vocab: int, context: int, max_asks: int, heartbeat: float,
                 dead_after: float, window: int = 4, queue_tokens: int = QUEUE_TOKENS) -> None:
        """``students``: the student clusters and their slots in the plan; ``vocab`` and
        ``context``: the teacher model's; ``max_asks``: asks a student's link may hold."""
        self.job_id, self.cluster, self.students = job_id, cluster, frozenset(students)
        self.welcome = LabelWelcome(cluster=cluster, topk=topk, values=values,
                                    max_tokens=max_tokens, vocab=vocab,
                                    context=min(context, max_tokens), max_asks=max_asks)
        self.heartbeat, self.dead_after, self.window = heartbeat, dead_after, window
        self.queue_tokens, self._context = queue_tokens, context
        self._ctx = server_context(pair, ca)
        self._listener = socket.create_server((bind, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._admission = Admission(total=32, per_address=4, deadline=HANDSHAKE_S)
        self._lock = threading.Lock()
        self._pending: collections.deque[_Ask] = collections.deque()
        self._queued_tokens = 0
        self._servers: list[_Server] = []
        self._students = StudentLinks(students)
        self._ids = itertools.count()
        self._asks = self._answers = self._refused = self._tokens = self._ask_bytes = 0
        self._failed = 0
        self._latency_s = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life

    def start(self) -> LabelRelay:
        for target, name in ((self._accept, "labels-accept"), (self._keep, "labels-alive")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("label relay of %s on port %d (students: %s)", self.cluster, self.port,
                 ", ".join(sorted(self.students)))
        return self

    def close(self) -> None:
        """Stop listening and end every link (their threads end with them)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._admission.close()
        for link in self._links():
            link.close()
        for t in self._threads:
            t.join(timeout=5.0)

    def counts(self) -> RelayCounts:
        with self._lock:
            return RelayCounts(self._asks, self._answers, len(self._pending),
                               len(self._servers), len(self._students), self._refused,
                               self._tokens, self._latency_s, self._ask_bytes, self._failed)

    def _links(self) -> list[LabelLink]:
        with self._lock:
            return [s.link for s in self._servers] + self._students.links()

    def _keep(self) -> None:
        keep_alive(self._links, self.heartbeat, self.dead_after, self._stop)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock, addr[0]), daemon=True,
                                 name=f"labels-{addr[0]}")
            t.start()

    def _serve(self, sock: socket.socket, ip: str) -> None:
        entry, _ = self._admission.admit(sock, ip)
        try:
            hello = self._handshake(sock)
        except (PeerRejected, WireError, OSError) as exc:
            with self._lock:
                self._refused += 1
            log.warning("label relay: refused %s: %s", ip, exc)
            with contextlib.suppress(OSError):
                sock.close()
            return
        finally:
            self._admission.release(entry)
        link, hello, cluster = hello
        if hello.side is Side.SERVER:
            self._run_server(link)
        else:
            self._run_student(link, cluster, hello.rank)

    def _handshake(self, sock: socket.socket) -> tuple[LabelLink, LabelHello, str]:
        if not first_bytes(sock):
            raise WireError("nothing sent")
        tls, ident = wrap_server(sock, self._ctx, job_id=self.job_id,
                                 roles={"worker", "relay"}, timeout=HANDSHAKE_S)
        try:
            tls.settimeout(HANDSHAKE_S)
            hello = decode(LabelHello, recv_small_frame(tls, HELLO_BYTES).meta)
            why = self._refusal(hello, ident.role, ident.cluster)
            if why is not None:
                send_frame(tls, LabelRefusal(reason=why).to_frame())
                close_after_refusal(tls)
                raise PeerRejected(why, peer=f"{ident.cluster}/{ident.name}")
            tls.settimeout(None)
        except BaseException:
            tls.close()
            raise
        w = self.welcome
        answer_bytes = max_answer_bytes(w.max_tokens, w.topk)
        if hello.side is Side.SERVER:  # it reads asks, at most its window at a time
            cap, queued = answer_bytes, queue_bound(self.window, max_ask_bytes(w.max_tokens))
        else:  # it reads answers, at most one for each ask it holds
            cap, queued = max_ask_bytes(w.max_tokens), queue_bound(w.max_asks, answer_bytes)
        link = LabelLink(tls, f"{ident.cluster}/{ident.name}", cap, queue_bytes=queued)
        return link, hello, ident.cluster

    def _refusal(self, hello: LabelHello, role: str, cluster: str) -> str | None:
        if hello.protocol != PROTOCOL:
            return f"soft-label protocol {hello.protocol}; this relay speaks {PROTOCOL}"
        if hello.job != self.job_id:
            return f"job {hello.job}; this is {self.job_id}"
        if hello.side is Side.SERVER and (cluster != self.cluster or role != "worker"):
            return (f"only {self.cluster}'s workers serve its soft labels (a {role} of "
                    f"{cluster} offered to)")
        if hello.side is Side.SERVER and (hello.vocab, hello.context) != (
                self.welcome.vocab, self._context):
            return (f"a server of a vocabulary of {hello.vocab} and a context of "
                    f"{hello.context}; this teacher's model has {self.welcome.vocab} and "
                    f"{self._context}")
        if hello.side is Side.STUDENT and cluster not in self.students:
            return (f"cluster {cluster} is not a student of this job (the students: "
                    f"{', '.join(sorted(self.students))})")
        return None

    # ------------------------------------------------------------------ students

    def _run_student(self, link: LabelLink, cluster: str, rank: int) -> None:
        with self._lock:
            old, why = self._students.add(link, cluster, rank)
        if why is not None:
            with self._lock:
                self._refused += 1
            log.warning("label relay: refused %s: %s", link.peer, why)
            link.end(LabelRefusal(reason=why).to_frame())
            return
        if old is not None:
            old.link.close(f"rank {rank} of {cluster} linked again")
        link.send(self.welcome.to_frame())
        try:
            while True:
                frame = link.recv()
                if frame.type is FrameType.BYE:
                    return
                if frame.type is not FrameType.LABELS_ASK:
                    raise WireError(f"a student sent {frame.type.name}; only asks are taken")
                if not self._asked(link, LabelAsk.from_frame(frame, self.welcome.max_tokens),
                                   frame.payload):
                    return
                self._dispatch()
        except (WireError, OSError) as exc:
            if not link.closed.is_set():
                log.info("label relay: student %s gone: %s", link.peer, exc)
        finally:
            link.close()
            with self._lock:
                self._students.remove(link)
                self._pending = collections.deque(a for a in self._pending
                                                  if a.student is not link)
                self._queued_tokens = sum(a.ask.tokens for a in self._pending)

    def _asked(self, link: LabelLink, ask: LabelAsk, payload: bytearray) -> bool:
        """Queue a student's ask, or fail it (its ids or width beyond the teacher's, the queue
        full); False: the link holds all the asks it may (it is ended, with why)."""
        w = self.welcome
        why = ask.beyond(payload, w.vocab, w.context)
        with self._lock:
            student = self._students.get(link)
            if student is None:  # replaced by its rank's new link
                return False
            if student.outstanding >= w.max_asks:
                self._refused += 1
                over = (f"more than {w.max_asks} asks outstanding on one link (the most "
                        "its WELCOME allows: max_asks)")
            else:
                over = None
                self._asks += 1
                self._ask_bytes += len(payload)
                if why is None and self._queued_tokens + ask.tokens > self.queue_tokens:
                    why = (f"the teacher's queue is full ({self._queued_tokens} tokens "
                           f"waiting, {self.queue_tokens} at most)")
                if why is None:
                    self._pending.append(_Ask(link, ask, payload))
                    self._queued_tokens += ask.tokens
                    student.outstanding += 1
                else:
                    self._failed += 1
        if over is not None:
            log.warning("label relay: ended %s: %s", link.peer, over)
            link.end(LabelRefusal(reason=over).to_frame())
            return False
        if why is not None:
            log.warning("label relay: ask %d of %s fails: %s", ask.seq, link.peer, why)
            link.send(LabelFailed(seq=ask.seq, reason=why, teacher=self.cluster).to_frame())
        return True

    # ------------------------------------------------------------------ servers

    def _run_server(self, link: LabelLink) -> None:
        server = _Server(link)
        link.send(self.welcome.to_frame())
        with self._lock:
            self._servers.append(server)
        log.info("label relay: server %s joined", link.peer)
        self._dispatch()
        try:
            while True:
                frame = link.recv()
                if frame.type is FrameType.BYE:
                    return
                if frame.type is FrameType.LABELS_FAILED:
                    self._server_failed(server, decode(LabelFailed, frame.meta))
                elif frame.type is FrameType.LABELS:
                    self._answered(server, frame)
                else:
                    raise WireError(f"a server sent {frame.type.name}; only labels are taken")
        except (WireError, OSError) as exc:
            if not link.closed.is_set():
                log.info("label relay: server %s gone: %s", link.peer, exc)
        finally:
            link.close()
            self._server_lost(server)
            self._dispatch()

    def _server_lost(self, server: _Server) -> None:
        """What a server held goes to the next, first in line; an ask lost with `LOSSES`
        servers fails (it may be what ended them)."""
        failed: list[_Ask] = []
        with self._lock:
            self._servers.remove(server)
            again: list[_Ask] = []
            for asked in server.inflight.values():
                asked.lost += 1
                (failed if asked.lost >= LOSSES else again).append(asked)
            self._pending.extendleft(reversed(again))
            self._queued_tokens += sum(a.ask.tokens for a in again)
            for asked in failed:
                self._done(asked)
            self._failed += len(failed)
        for asked in failed:
            why = f"{LOSSES} serving ranks were lost while they ran it"
            log.warning("label relay: ask %d of %s fails: %s", asked.ask.seq,
                        asked.student.peer, why)
            asked.student.send(LabelFailed(seq=asked.ask.seq, reason=why,
                                           teacher=self.cluster).to_frame())

    def _server_failed(self, server: _Server, failed: LabelFailed) -> None:
        """A server could not run an ask: its student is told why; it is not asked again."""
        with self._lock:
            asked = server.inflight.pop(failed.seq, None)
            if asked is None:
                raise WireError(f"LABELS_FAILED for {failed.seq}, which was not asked")
            self._failed += 1
            self._done(asked)
        log.warning("label relay: ask %d of %s fails: %s", asked.ask.seq, asked.student.peer,
                    failed.reason)
        asked.student.send(LabelFailed(seq=asked.ask.seq, reason=failed.reason,
                                       teacher=self.cluster).to_frame())
        self._dispatch()

    def _done(self, asked: _Ask) -> None:
        """An ask answered or failed: its student's link holds one fewer (under the lock)."""
        student = self._students.get(asked.student)
        if student is not None:
            student.outstanding -= 1

    def _answered(self, server: _Server, frame: Frame) -> None:
        ans = decode(LabelAnswer, frame.meta,
                     limits={"max_tokens": self.welcome.max_tokens})
        if len(frame.payload) != payload_nbytes(ans.rows, ans.k, ans.vocab, ans.values):
            raise WireError(f"LABELS of {ans.rows} x {ans.k} in {len(frame.payload)} bytes")
        with self._lock:
            asked = server.inflight.pop(ans.seq, None)
            if asked is None:
                raise WireError(f"LABELS for {ans.seq}, which was not asked")
            if ans.rows != asked.ask.tokens:
                raise WireError(f"LABELS of {ans.rows} rows for an ask of {asked.ask.tokens} "
                                "tokens")
            self._answers += 1
            self._tokens += ans.rows
            self._latency_s += time.monotonic() - asked.arrived
            self._done(asked)
        out = LabelAnswer(seq=asked.ask.seq, rows=ans.rows, k=ans.k, vocab=ans.vocab,
                          values=ans.values, teacher=self.cluster)
        asked.student.send(out.to_frame(frame.payload))
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting asks to the servers with room (the least busy first)."""
        sends: list[tuple[LabelLink, Frame]] = []
        with self._lock:
            while self._pending:
                open_ = [s for s in self._servers
                         if len(s.inflight) < self.window and not s.link.closed.is_set()]
                if not open_:
                    break
                server = min(open_, key=lambda s: len(s.inflight))
                asked = self._pending.popleft()
                self._queued_tokens -= asked.ask.tokens
                if asked.student.closed.is_set():
                    continue
                number = next(self._ids)
                server.inflight[number] = asked
                sends.append((server.link,
                              replace(asked.ask, seq=number).to_frame(asked.payload)))
        for link, frame in sends:
            link.send(frame)  # a failed send ends the link: its reader gives the ask back
