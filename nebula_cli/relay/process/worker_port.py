"""The worker port: this cluster's rank 0 (a :class:`nebula_cli.relay.process.client.RelayClient`)
connects with a worker certificate of this job and cluster and asks for rounds; on the relay's
own host it connects to the relay's Unix socket instead (no TLS: the kernel says its uid, which
must be the relay's; tensors travel as sealed memfds, :mod:`nebula_cli.relay.net.local_socket`).

    HELLO {role: worker, cluster[, layout]}         -> WELCOME {cluster, codec, clusters, ...}
    CONTRIB {op: allreduce, round, numel[, info]}   -> RESULT {round_id, present, weights,
             + chunks                                  next_h, next_merge, seconds, ...} + chunks
                                                       [+ STATE chunks when catching up]
    STATE {op: publish, round, numel, parts} + chunks -> STATE {op: stored, round}
    STATE_REQUEST {op: fetch}                       -> STATE {op: state, round|null, numel,
                                                              parts} + chunks
    STATE_REQUEST {op: final[, wait]}               -> STATE {op: final, round|null, ...} (after
        every peer's workers finished or gave up: the state to end with, or null: keep yours)
    BYE                                             (rank 0 is done: peers stop waiting for it)

``info`` (relay.cadence.RoundInfo: samples, step time, the previous round's cost, with overlap
when its average arrived) goes into this relay's READY; ``weights``, ``next_h`` and
``next_merge`` are the round's decision (the average's weights, with ``inner_steps: auto`` the
H to train before the next round, with overlap the step its average is applied at).

A published state is theta_global (parts 1) or theta_global followed by the outer momentum
(parts 2); a STATE handed to a worker says which. Each frame is decoded once, where it is
received, into its message of :mod:`nebula_cli.relay.process.worker_messages`; a frame that is
not a request, or does not fit its message, is refused and ends the session.

The first registration (a HELLO's ``layout`` {shapes, dtypes}, else the first tensor's size)
fixes what this cluster syncs; a tensor of another size is refused, one larger than that is
refused before it is read (and the connection closed). At most MAX_WORKER_CONNECTIONS at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

import torch

from nebula_cli.pki import PeerRejected, wrap_server
from nebula_cli.relay.net.framing import check_numel, recv_tensor, send_frames, send_tensor
from nebula_cli.relay.net.limits import (
    HANDSHAKE_TIMEOUT,
    MAX_SYNC_NUMEL,
    MAX_WORKER_CONNECTIONS,
    WORKER_KEEPALIVE_IDLE,
    Gate,
    LimitExceeded,
    Refusals,
    SyncSize,
)
from nebula_cli.relay.net.local_socket import (
    FIXED_SIZE,
    HopSocket,
    LocalSocket,
    SharedMemoryError,
    SharedPool,
    peer_uid,
)
from nebula_cli.relay.net.messages import Refusal
from nebula_cli.relay.net.schema import MessageError, encode
from nebula_cli.relay.net.wire import (
    ConnectionClosed,
    Frame,
    FrameType,
    WireError,
    close_after_refusal,
    recv_frame,
)
from nebula_cli.relay.process.worker_messages import (
    Contrib,
    FetchState,
    FinalState,
    Publish,
    RoundReply,
    StateOp,
    StateReply,
    WorkerHello,
    WorkerRequest,
    WorkerWelcome,
    decode_request,
)
from nebula_cli.relay.protocol.results import GlobalState
from nebula_cli.relay.protocol.rounds import Rounds

log = logging.getLogger("nebula.relay")

class _Refused(Exception):
    """A request refused with an ERROR frame; ``close``: the stream cannot go on."""

    def __init__(self, reason: str, *, close: bool = False) -> None:
        super().__init__(reason)
        self.close = close


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes after WORKER_KEEPALIVE_IDLE s of silence, dead after a few misses
    (Linux options; elsewhere only SO_KEEPALIVE)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", WORKER_KEEPALIVE_IDLE), ("TCP_KEEPINTVL", 10),
                        ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class WorkerPort:
    """Serves worker connections. ``welcome()`` is the WELCOME meta; ``published()`` runs
    after a worker stored a global state."""

    def __init__(self, cluster: str, job_id: str, server_ctx: ssl.SSLContext, rounds: Rounds,
                 *, welcome: Callable[[], WorkerWelcome], published: Callable[[], None],
                 refusals: Refusals, stopping: threading.Event,
                 shared: SharedPool | None = None) -> None:
        self.me, self.job_id, self.server_ctx, self.rounds = cluster, job_id, server_ctx, rounds
        self.shared = shared
        """Where the averages a local worker maps are built (None: not on this host)."""
        self._welcome, self._published = welcome, published
        self.refusals, self.stopping = refusals, stopping
        self.sessions = Gate(MAX_WORKER_CONNECTIONS)
        self.socks: set[HopSocket] = set()
        self._lock = threading.Lock()

    def handshake(self, sock: socket.socket, addr: str) -> Callable[[], None] | None:
        """TLS with a worker certificate of this cluster; the session to run, or None."""
        try:
            tls, ident = wrap_server(sock, self.server_ctx, job_id=self.job_id,
                                     roles={"worker"}, cluster=self.me,
                                     timeout=HANDSHAKE_TIMEOUT)
        except PeerRejected:
            return None
        if not self.sessions.enter("workers"):
            self.refusals.refuse("worker connection", f"{ident.name} ({addr})",
                                 f"{MAX_WORKER_CONNECTIONS} workers are connected already")
            tls.close()
            return None
        return lambda: self._session(tls, ident.name, addr)

    def local_handshake(self, sock: socket.socket, addr: str) -> Callable[[], None] | None:
        """A connection on the Unix socket: a process of this relay's own uid (SO_PEERCRED),
        the session to run; else refused and closed before a byte is read."""
        conn = LocalSocket(sock, seals=FIXED_SIZE)
        try:
            uid = peer_uid(sock)
        except OSError:
            uid = -1
        if uid != os.geteuid():
            self.refusals.refuse("worker connection", f"uid {uid} on the local socket",
                                 f"only processes of the relay's own uid ({os.geteuid()}) "
                                 "may use it")
            conn.close()
            return None
        if not self.sessions.enter("workers"):
            self.refusals.refuse("worker connection", "the local socket",
                                 f"{MAX_WORKER_CONNECTIONS} workers are connected already")
            conn.close()
            return None
        return lambda: self._session(conn, "local worker", addr)

    def close_all(self) -> None:
        with self._lock:
            socks = list(self.socks)
        for s in socks:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(s.sock if isinstance(s, LocalSocket) else s,
                                       socket.SHUT_RDWR)

    def _session(self, tls: HopSocket, name: str, addr: str) -> None:
        with self._lock:
            self.socks.add(tls)
        try:
            how = "the local socket" if isinstance(tls, LocalSocket) else f"mutual TLS ({addr})"
            log.info("worker %s connected through %s", name, how)
            tls.settimeout(None)  # a worker may be quiet for many inner steps: no timeout,
            if not isinstance(tls, LocalSocket):  # (the kernel ends a local one at once)
                keep_alive(tls)  # but a worker gone without a word frees its slot in ~a minute
            self._serve(tls, name, addr)
        except ConnectionClosed:
            pass
        except (OSError, WireError) as exc:
            if not self.stopping.is_set():
                log.warning("worker %s (%s): %s", name, addr, exc)
        finally:
            with self._lock:
                self.socks.discard(tls)
            self.sessions.leave("workers")
            if self.shared is not None and isinstance(tls, LocalSocket):
                self.shared.forget(tls.lent)
            tls.close()

    def _serve(self, sock: HopSocket, name: str, addr: str) -> None:
        while not self.stopping.is_set():
            frame = recv_frame(sock, max_payload=0)
            try:
                try:
                    req = decode_request(frame)
                except MessageError as exc:  # whatever it announced cannot be skipped
                    raise _Refused(str(exc), close=True) from None
                if not self._handle(sock, req):
                    return
                if isinstance(sock, LocalSocket) and sock.pending_fds:
                    raise _Refused("a file descriptor sent with a frame that carries no tensor",
                                   close=True)
            except _Refused as exc:
                self.refusals.refuse("worker request", f"{name} ({addr})", str(exc))
                send_frames(sock, [Refusal(reason=str(exc)).to_frame()])
                if exc.close:  # what the worker still sends is read, so it reads the refusal
                    close_after_refusal(sock)
                    return

    def _tensor(self, sock: HopSocket, ftype: FrameType, numel: int,
                parts: int = 1) -> torch.Tensor:
        """Read a worker's tensor of this cluster's sync size times ``parts`` (registering the
        size the first time); _Refused otherwise."""
        sync = self.rounds.sync
        cap = (sync.numel if sync is not None else MAX_SYNC_NUMEL) * parts
        try:
            numel = check_numel(numel, cap)
        except WireError as exc:
            raise _Refused(f"{exc}: this relay syncs {cap // parts} elements", close=True) from None
        try:
            x = recv_tensor(sock, ftype, numel, max_numel=cap)
        except SharedMemoryError as exc:
            raise _Refused(str(exc), close=True) from None
        size = numel // parts
        try:
            if numel % parts:
                raise LimitExceeded(f"{numel} elements do not split into {parts} parts")
            self.rounds.register(SyncSize.flat(size) if sync is None else sync)
            if sync is not None and size != sync.numel:
                raise LimitExceeded(f"a tensor of {size} elements; this relay syncs "
                                    f"{sync.numel} (its workers' first registration)")
        except LimitExceeded as exc:
            raise _Refused(str(exc)) from None
        return x

    def _handle(self, sock: HopSocket, req: WorkerRequest) -> bool:
        """Answer one request; False when the worker said goodbye."""
        rounds = self.rounds
        if isinstance(req, WorkerHello):
            for key, theirs, mine in (("cluster", req.cluster, self.me),
                                      ("job_id", req.job_id, self.job_id)):
                if theirs is not None and theirs != mine:
                    raise _Refused(f"a worker of {key} {theirs!r} at the relay of "
                                   f"{key} {mine!r}", close=True)
            if req.layout is not None:
                try:
                    rounds.register(req.layout)
                except LimitExceeded as exc:
                    raise _Refused(str(exc), close=True) from None
            send_frames(sock, [Frame(FrameType.WELCOME, encode(self._welcome()))])
        elif isinstance(req, Contrib):
            t0 = time.perf_counter()
            x = self._tensor(sock, FrameType.CONTRIB, req.numel)
            upload = time.perf_counter() - t0
            if self.shared is not None and isinstance(sock, LocalSocket) and req.released:
                ours = sock.lent & set(req.released)
                sock.lent -= ours
                self.shared.release(ours)
            out = rounds.local_round(req.round, x, req.info)
            token = None
            if self.shared is not None and isinstance(sock, LocalSocket):
                token = self.shared.lend(out.tensor)  # until released
                if token is not None:
                    sock.lent.add(token)
            send_tensor(sock, FrameType.RESULT,
                        encode(RoundReply.of(out, upload_s=upload, shm=token)), out.tensor)
            if out.global_state is not None:
                send_tensor(sock, FrameType.STATE, encode(StateReply(
                    op=None, round=out.round_id,
                    parts=out.global_state.numel() // out.tensor.numel(),
                    numel=out.global_state.numel())), out.global_state)
        elif isinstance(req, Publish):
            x = self._tensor(sock, FrameType.STATE, req.numel, req.parts)
            rounds.publish(GlobalState(req.round, x, parts=req.parts))
            send_frames(sock, [Frame(FrameType.STATE,
                                     encode(StateReply(op=StateOp.STORED, round=req.round)))])
            self._published()
        elif isinstance(req, FinalState):
            rounds.mark_finished()
            self._published()  # peers learn that this cluster has finished
            self._send_state(sock, StateOp.FINAL, rounds.final_state(req.wait))
        elif isinstance(req, FetchState):
            self._send_state(sock, StateOp.STATE, rounds.best_state())
        else:  # Bye: rank 0 closed its client, its training is over
            rounds.mark_finished()
            self._published()
            return False
        return True

    @staticmethod
    def _send_state(sock: HopSocket, op: StateOp, st: GlobalState | None) -> None:
        if st is None:
            send_frames(sock, [Frame(FrameType.STATE, encode(StateReply(op=op, round=None)))])
        else:
            send_tensor(sock, FrameType.STATE, encode(StateReply(
                op=op, round=st.round_id, parts=st.parts, numel=st.tensor.numel())), st.tensor)
