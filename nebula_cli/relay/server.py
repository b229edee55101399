"""The relay process of one cluster: workers connect locally, peer relays over the WAN.

``python -m nebula_cli.relay.server --config relay.json`` runs until SIGTERM (exit 0).

Links. Every pair of relays shares one mutually authenticated TLS connection: the cluster
listed *later* in ``clusters`` dials the earlier one (reconnecting with exponential backoff,
capped at 5 s); a newer connection from a peer replaces an older one. Peers must present a
relay certificate of this job for one of the job's clusters; workers a worker certificate of
this job and this cluster. Each link has a sender thread (round-control frames go before bulk
chunks; WAN shaping is applied here) and a receiver thread, so sending and receiving overlap.
Idle links carry heartbeats; a link silent for 3 heartbeats is closed.

A round (see :mod:`nebula_cli.relay.allreduce`):

1. The worker sends its fp32 contribution for round ``r``; the deadline is ``round_timeout``
   from now. A non-finite contribution is rejected here (logged, never sent).
2. If a connected peer has already completed round ``r`` this cluster is *behind*: it gets
   round ``r``'s average from a peer that has it, else a peer's published global state.
3. Otherwise READY(r) goes to the coordinator (the first cluster in ``clusters`` order among
   this relay and its connected peers), which answers START(r, present, rejected, missing)
   once every cluster is ready or its deadline passed (or BEHIND). The coordinator's deadline
   is ``round_timeout`` after the first READY of the round, i.e. after the first cluster's
   contribution arrived: a cluster that is later than that is left out.
4. The present relays exchange encoded chunks (direct for 2, shard owners for 3+) while the
   contribution is still being encoded; results are bit-identical on every relay.
5. A cluster left out of the round (late, or rejected for a non-finite update) gets the
   round's average of the others from a present peer, so it stays in step; if nobody is
   present it gets zeros (a zero delta). If a present peer disappears mid-exchange, the
   survivors fetch the result from one that completed, else redo the round (new attempt, at
   most 3, then a zero delta). With no peer reachable at all a cluster averages alone.

Frames (:mod:`nebula_cli.relay.wire`) on a peer link; ``meta["op"]`` says what a frame is:

- HELLO / WELCOME: cluster, job, protocol, codec, block_size, chunk_numel (must match), progress.
- HEARTBEAT: progress {done, state_round, result_round}; op ping / pong (round-trip time).
- ROUND: op ready / start / behind / abort (round agreement, no payload).
- PEER_CHUNK: op contrib /
  avg with one encoded chunk (keyed by round, attempt, coordinator and chunk index).
- STATE_REQUEST: op result {round} or op state {min_round, wait}; answered with RESULT or
  STATE frames (a header, then fp32 chunks {req, lo}).
- ERROR (refusal, then close), BYE (orderly close).

Every round appends a line to ``metrics_file`` and rewrites ``status_file``; missed deadlines,
rejections, disconnections and catch-ups are logged as warnings and counted in the status.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import signal
import socket
import ssl
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nebula_cli.errors import NebulaError
from nebula_cli.pki import (
    CertPair,
    PeerRejected,
    client_context,
    server_context,
    wrap_client,
    wrap_server,
)
from nebula_cli.relay.allreduce import (
    BEHIND,
    Coordinator,
    Decision,
    ExchangeError,
    RoundExchange,
    Schedule,
)
from nebula_cli.relay.codecs import (
    CodecError,
    Encoded,
    ErrorFeedback,
    chunk_spans,
    get_codec,
    iter_chunks,
)
from nebula_cli.relay.config import RelayConfig, parse_addr
from nebula_cli.relay.duplex import DuplexTLS
from nebula_cli.relay.framing import recv_tensor, send_frames, tensor_frames, tune_buffers
from nebula_cli.relay.shaping import Shaper
from nebula_cli.relay.wire import (
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    ConnectionClosed,
    Frame,
    FrameType,
    WireError,
    encode_frame,
    encode_meta,
    recv_frame,
)

log = logging.getLogger("nebula.relay")

PROTOCOL = 2  # 2: round control in ROUND frames
HANDSHAKE_TIMEOUT = 10.0
BACKOFF_MAX = 5.0
STARTUP_GRACE = BACKOFF_MAX + 1.0
"""After a (re)start, a round waits up to this long (from the start) for peers that have not
been connected yet, so that a restarted relay learns how far its peers are before it takes
part in a round."""
MAX_ATTEMPTS = 3
RESULT_CHUNK = 4 << 20  # fp32 elements per frame when a result or a state is served


class LinkDown(NebulaError):
    """The link to a peer is not connected (or just went away)."""


# ---------------------------------------------------------------------- peer links


class _Watched:
    """The receive side of a link's socket, noting the time of every byte that arrives (so a
    large frame on a slow link still counts as traffic)."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        n = self.link.io.recv_into(buf, nbytes)
        self.link.last_rx = time.monotonic()
        return n


class PeerLink:
    """One live TLS connection to a peer relay: a sender thread and a receiver thread.

    Both use the socket through :class:`DuplexTLS`, which serialises their OpenSSL calls (two
    threads may not be inside SSL_read and SSL_write at once) and waits outside its lock.
    Liveness is checked by the relay's ticker (:attr:`last_rx`), which closes a silent link.
    """

    def __init__(self, relay: Relay, cluster: str, sock: ssl.SSLSocket, hello: dict[str, Any]):
        self.relay = relay
        self.cluster = cluster
        self.sock = sock
        self.io = DuplexTLS(sock)
        self.last_rx = time.monotonic()
        self.addr = _peer_addr(sock)
        self.shaper = Shaper.from_config(relay.cfg.shaping)
        self.heartbeat = relay.cfg.heartbeat
        self.max_payload = relay.max_payload
        self.done = int(hello.get("done", -1))
        self.state_round = _opt_int(hello.get("state_round"))
        self.result_round = _opt_int(hello.get("result_round"))
        self.bytes_sent = 0
        self.bytes_received = 0
        self.connected_at = time.time()
        self.closed = False
        self.reason = ""
        self._control: deque[tuple[Frame, float]] = deque()
        self._data: deque[tuple[Frame, float]] = deque()
        self._cv = threading.Condition()
        self._bulk_pending = 0  # bulk frames queued or being written
        self._last_tx = time.monotonic()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"relay-send-{cluster}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"relay-recv-{cluster}", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def send(self, frame: Frame, *, bulk: bool = False) -> None:
        """Queue a frame (control frames jump ahead of bulk ones). LinkDown if closed."""
        with self._cv:
            if self.closed:
                raise LinkDown(f"link to {self.cluster} is down ({self.reason})")
            (self._data if bulk else self._control).append((frame, self.shaper.stamp()))
            self._bulk_pending += bulk
            self._cv.notify()

    def flush(self, timeout: float) -> bool:
        """Wait until every bulk frame queued so far has been written (False on time-out)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._bulk_pending == 0 or self.closed, timeout)

    def close(self, reason: str) -> None:
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self.reason = reason
            self._control.clear()
            self._data.clear()
            self._bulk_pending = 0
            self._cv.notify_all()
        # wakes both threads; the receiver closes the socket when they are done
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        self.relay.link_down(self, reason)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _next(self) -> tuple[Frame, float, bool] | None:
        with self._cv:
            while not self.closed:
                if self._control:
                    return (*self._control.popleft(), False)
                if self._data:
                    return (*self._data.popleft(), True)
                idle = time.monotonic() - self._last_tx
                if idle >= self.heartbeat:
                    break
                self._cv.wait(self.heartbeat - idle)
            else:
                return None
        return Frame(FrameType.HEARTBEAT, self.relay.progress_meta()), time.monotonic(), False

    def _send_loop(self) -> None:
        try:
            while (item := self._next()) is not None:
                frame, stamp, bulk = item
                parts = encode_frame(frame, max_payload=self.max_payload)
                if self.shaper.enabled:
                    n = self.shaper.send(self.io.sendall, parts, stamp)
                else:
                    n = 0
                    for part in parts:
                        self.io.sendall(part)
                        n += memoryview(part).nbytes
                self.bytes_sent += n
                self._last_tx = time.monotonic()
                if bulk:
                    with self._cv:
                        self._bulk_pending = max(0, self._bulk_pending - 1)
                        self._cv.notify_all()
        except (OSError, WireError) as exc:
            self.close(f"send failed: {exc}")

    def _recv_loop(self) -> None:
        watched: Any = _Watched(self)
        try:
            while not self.closed:
                frame = recv_frame(watched, max_payload=self.max_payload)
                self.bytes_received += (HEADER_SIZE + len(encode_meta(frame.meta))
                                        + len(frame.payload))
                if frame.type == FrameType.BYE:
                    self.close("peer said goodbye")
                    break
                if frame.type == FrameType.ERROR:
                    self.close(f"peer refused: {frame.meta.get('reason')}")
                    break
                self.relay.on_peer_frame(self, frame)
        except ConnectionClosed as exc:
            self.close(str(exc))
        except (OSError, WireError, ExchangeError, CodecError, KeyError, TypeError,
                ValueError) as exc:
            self.close(f"protocol error: {exc}")
        finally:
            self.close("closed")
            self._threads[0].join(5.0)
            self.sock.close()


# ---------------------------------------------------------------------- rounds


@dataclass
class Outcome:
    """What the relay tells its worker at the end of a round."""

    tensor: torch.Tensor
    present: list[str]
    round_id: int
    rejected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    global_state: torch.Tensor | None = None
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    mode: str = ""


class OwnChunks:
    """This relay's encoded contribution, produced chunk by chunk by a background encoder."""

    def __init__(self, x: torch.Tensor, chunk_numel: int, align: int, codec: Any,
                 feedback: ErrorFeedback | None) -> None:
        self.chunks: list[Encoded] = []
        self.error: str | None = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, args=(x, chunk_numel, align, codec, feedback),
            name="relay-encoder", daemon=True)
        self._thread.start()

    def _run(self, x: torch.Tensor, chunk_numel: int, align: int, codec: Any,
             feedback: ErrorFeedback | None) -> None:
        try:
            for k, chunk in enumerate(iter_chunks(x, chunk_numel, align=align)):
                if codec.name == "none":  # fp32 as is: the payload is a view, no copy
                    enc = Encoded("none", chunk.numel(), {}, memoryview(chunk.numpy()).cast("B"))
                elif feedback is not None:
                    enc = feedback.encode(chunk, key=k)
                else:
                    enc = codec.encode(chunk)
                with self._cv:
                    self.chunks.append(enc)
                    self._cv.notify_all()
        except CodecError as exc:
            with self._cv:
                self.error = str(exc)
                self._cv.notify_all()

    def get(self, k: int, timeout: float) -> Encoded:
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.chunks) > k or self.error, timeout):
                raise ExchangeError(f"encoding chunk {k} took longer than {timeout:g}s")
            if len(self.chunks) > k:
                return self.chunks[k]
            raise ExchangeError(f"encoding failed: {self.error}")


class Fetch:
    """A pending request to a peer for a round result or a global state (assembled here)."""

    def __init__(self, req: int, link: PeerLink) -> None:
        self.req = req
        self.link = link
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
        with self.cv:
            if self.meta is None:
                self.meta = frame.meta
                numel = frame.meta.get("numel")
                if frame.meta.get("status") == "ok" and isinstance(numel, int) and numel >= 0:
                    self.tensor = torch.empty(numel, dtype=torch.float32)
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


# ---------------------------------------------------------------------- the relay


class Relay:
    """One cluster's relay: listeners, peer links, rounds, status. ``start()``/``stop()``."""

    def __init__(self, cfg: RelayConfig) -> None:
        self.cfg = cfg
        self.me = cfg.cluster
        self.codec = get_codec(cfg.codec, block_size=cfg.block_size)
        self.feedback = ErrorFeedback(self.codec) if cfg.error_feedback else None
        pair, ca = CertPair(Path(cfg.tls.cert), Path(cfg.tls.key)), Path(cfg.tls.ca)
        self.server_ctx = server_context(pair, ca)
        self.server_ctx.num_tickets = 0  # no post-handshake writes on the reader thread
        self.client_ctx = client_context(pair, ca)
        self.max_payload = max(DEFAULT_MAX_PAYLOAD, 4 * cfg.chunk_numel + (1 << 20))
        self.order = {c: i for i, c in enumerate(cfg.clusters)}
        self.coordinator = Coordinator(self.me, cfg.clusters, cfg.round_timeout)
        self.grace = max(2.0, 2 * cfg.heartbeat)
        self.fetch_timeout = max(120.0, 10 * cfg.round_timeout)
        self.stall_timeout = max(30.0, 3 * cfg.round_timeout)

        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.links: dict[str, PeerLink] = {}
        self.ever_linked: set[str] = set()
        self.decisions: dict[tuple[int, str], Decision] = {}  # (round, coordinator) ->
        self.behind_rounds: set[int] = set()
        self.exchanges: dict[tuple[int, int, str], RoundExchange] = {}
        self.early: dict[tuple[int, int, str], list[tuple[str, Frame]]] = {}
        self.phase: dict[int, str] = {}  # round -> exchanging | recovering | done
        self.fetches: dict[int, Fetch] = {}
        self.pings: dict[int, list[float]] = {}
        self._req = itertools.count(1)
        self.round_lock = threading.Lock()
        self.outcomes: dict[int, Outcome] = {}
        self.done_round = -1
        self.result: tuple[int, list[str], list[str], torch.Tensor] | None = None
        self.state: tuple[int, torch.Tensor] | None = None
        self.stats = {"rounds": 0, "events": 0, "missed": 0, "rejected": 0, "partial_rounds": 0}
        self.last: dict[str, Any] = {}
        self.closed_bytes = [0, 0]  # bytes of links that are gone
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.listeners: list[socket.socket] = []
        self.workers: set[ssl.SSLSocket] = set()
        self._status_dirty = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind both listeners and start accepting, dialing and ticking."""
        for addr, handler in ((self.cfg.peer_listen, self._on_peer_socket),
                              (self.cfg.worker_listen, self._on_worker_socket)):
            host, port = parse_addr(addr)
            try:
                ls = socket.create_server((host, port), backlog=64)
            except OSError as exc:
                self.stop()
                raise NebulaError(f"relay cannot listen on {addr}: {exc.strerror or exc}") from exc
            ls.settimeout(0.5)
            self.listeners.append(ls)
            self._spawn(self._accept_loop, ls, handler, name=f"relay-accept-{port}")
        for peer in self.cfg.dials:
            self._spawn(self._dial_loop, peer, name=f"relay-dial-{peer}")
        self._spawn(self._tick_loop, name="relay-tick")
        log.info("relay %s of job %s: peers on %s, workers on %s, codec %s, dials %s",
                 self.me, self.cfg.job_id, self.cfg.peer_listen, self.cfg.worker_listen,
                 self.codec.name, self.cfg.dials or "nobody")
        self._write_status()

    def stop(self) -> None:
        """Close everything this relay opened; bounded waits."""
        self.stopping.set()
        for ls in self.listeners:
            with contextlib.suppress(OSError):
                ls.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
            ls.close()
        with self.lock:
            links = list(self.links.values())
            workers = list(self.workers)
            for ex in self.exchanges.values():
                ex.fail("relay stopping")
            self.cv.notify_all()
        for link in links:
            with contextlib.suppress(LinkDown):
                link.send(Frame(FrameType.BYE))
        time.sleep(0.05 if links else 0)
        for link in links:
            link.close("relay stopping")
        for w in workers:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(w, socket.SHUT_RDWR)
        for link in links:
            link.join(2.0)
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(2.0)
        self._write_status(state="stopped")

    def _spawn(self, fn: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        return t

    def _event(self, msg: str, *args: Any) -> None:
        with self.lock:
            self.stats["events"] += 1
        log.warning(msg, *args)
        self._status_dirty.set()

    # ------------------------------------------------------------------ accepting and dialing

    def _accept_loop(self, ls: socket.socket, handler: Callable[[socket.socket], None]) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                time.sleep(0.1)
                continue
            sock.settimeout(None)
            tune_buffers(sock)
            self._spawn(handler, sock, name="relay-conn")

    def _hello_meta(self) -> dict[str, Any]:
        return {"role": "relay", "cluster": self.me, "job_id": self.cfg.job_id,
                "protocol": PROTOCOL, "codec": self.codec.name, "block_size": self.cfg.block_size,
                "chunk_numel": self.cfg.chunk_numel, **self.progress_meta()}

    def _compatible(self, meta: dict[str, Any]) -> str | None:
        mine = self._hello_meta()
        for key in ("protocol", "job_id", "codec", "block_size", "chunk_numel"):
            if meta.get(key) != mine[key]:
                return f"{key} {meta.get(key)!r} differs from this relay's {mine[key]!r}"
        return None

    def _on_peer_socket(self, sock: socket.socket) -> None:
        addr = _peer_addr(sock)
        try:
            tls, ident = wrap_server(sock, self.server_ctx, job_id=self.cfg.job_id,
                                     roles={"relay"}, timeout=HANDSHAKE_TIMEOUT)
        except PeerRejected:
            return  # pki logged the reason and the address
        try:
            if ident.cluster not in self.cfg.accepts:
                why = ("is not a cluster of this job" if ident.cluster not in self.order
                       else "must be dialed by this relay, not dial it")
                log.warning("refused peer %s: relay of cluster %s %s", addr, ident.cluster, why)
                _refuse(tls, f"cluster {ident.cluster} {why}")
                return
            tls.settimeout(HANDSHAKE_TIMEOUT)
            hello = recv_frame(tls)
            reason = (f"expected HELLO, got {hello.type.name}" if hello.type != FrameType.HELLO
                      else self._compatible(hello.meta))
            if reason or hello.meta.get("cluster") != ident.cluster:
                reason = reason or "HELLO names another cluster than its certificate"
                log.warning("refused peer %s (%s): %s", addr, ident.cluster, reason)
                _refuse(tls, reason)
                return
            send_frames(tls, [Frame(FrameType.WELCOME, self._hello_meta())])
        except (OSError, WireError) as exc:
            log.warning("peer %s (%s) lost during hello: %s", addr, ident.cluster, exc)
            tls.close()
            return
        self._add_link(ident.cluster, tls, hello.meta)

    def _dial_loop(self, peer: str) -> None:
        host, port = parse_addr(self.cfg.peers[peer])
        delay, failures = 0.1, 0
        while not self.stopping.is_set():
            with self.lock:
                link = self.links.get(peer)
                if link is not None and not link.closed:
                    self.cv.wait(1.0)
                    continue
            try:
                raw = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT)
                tune_buffers(raw)
                tls, _ = wrap_client(raw, self.client_ctx, job_id=self.cfg.job_id,
                                     roles={"relay"}, cluster=peer, timeout=HANDSHAKE_TIMEOUT)
                try:
                    tls.settimeout(HANDSHAKE_TIMEOUT)
                    send_frames(tls, [Frame(FrameType.HELLO, self._hello_meta())])
                    welcome = recv_frame(tls)
                    if welcome.type == FrameType.ERROR:
                        raise NebulaError(f"refused: {welcome.meta.get('reason')}")
                    if welcome.type != FrameType.WELCOME:
                        raise WireError(f"expected WELCOME, got {welcome.type.name}")
                    reason = self._compatible(welcome.meta)
                    if reason:
                        raise NebulaError(reason)
                except BaseException:
                    tls.close()
                    raise
                self._add_link(peer, tls, welcome.meta)
                delay, failures = 0.1, 0
            except (OSError, NebulaError) as exc:
                failures += 1
                loud = failures in (1, 10) or failures % 100 == 0
                level = logging.WARNING if loud else logging.DEBUG
                log.log(level, "cannot reach peer %s at %s (attempt %d): %s; retrying in %.1fs",
                        peer, self.cfg.peers[peer], failures, exc, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _add_link(self, cluster: str, sock: ssl.SSLSocket, hello: dict[str, Any]) -> None:
        link = PeerLink(self, cluster, sock, hello)
        with self.lock:
            if self.stopping.is_set():
                sock.close()
                return
            old = self.links.get(cluster)
            self.links[cluster] = link
            self.ever_linked.add(cluster)
            self.cv.notify_all()
        if old is not None:
            old.close("replaced by a new connection")
        if self.coordinator_view() != self.me:
            self.coordinator.drop_open()  # the clusters waiting on it re-send READY
        link.start()
        log.info("peer %s connected (%s); its round %d", cluster, link.addr, link.done)
        self._on_progress()
        self._status_dirty.set()

    def link_down(self, link: PeerLink, reason: str) -> None:
        """Called once per link when it closes."""
        with self.lock:
            self.closed_bytes[0] += link.bytes_sent
            self.closed_bytes[1] += link.bytes_received
            link.bytes_sent = link.bytes_received = 0
            current = self.links.get(link.cluster) is link
            if current:
                del self.links[link.cluster]
            for ex in self.exchanges.values():
                if link.cluster in ex.schedule.present:
                    ex.fail(f"lost the link to {link.cluster}: {reason}")
            for f in self.fetches.values():
                if f.link is link:
                    f.fail(f"link to {link.cluster} down")
            self.cv.notify_all()
        if not current or self.stopping.is_set():
            return
        if reason == "peer said goodbye":
            log.info("peer %s (%s) stopped", link.cluster, link.addr)
            self._status_dirty.set()
        else:
            self._event("peer %s disconnected (%s): %s", link.cluster, link.addr, reason)

    def connected(self) -> list[str]:
        with self.lock:
            return sorted(self.links, key=self.order.__getitem__)

    def coordinator_view(self) -> str:
        with self.lock:
            return min([self.me, *self.links], key=self.order.__getitem__)

    def progress_meta(self) -> dict[str, Any]:
        with self.lock:
            return {"done": self.done_round,
                    "state_round": self.state[0] if self.state else None,
                    "result_round": self.result[0] if self.result else None}

    def newest_done(self) -> int:
        with self.lock:
            return max([self.done_round, *(link.done for link in self.links.values())])

    def _send_to(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
        with self.lock:
            link = self.links.get(cluster)
        if link is None:
            return False
        try:
            link.send(frame, bulk=bulk)
            return True
        except LinkDown:
            return False

    def _broadcast_progress(self) -> None:
        meta = self.progress_meta()
        for c in self.connected():
            self._send_to(c, Frame(FrameType.HEARTBEAT, meta))

    # ------------------------------------------------------------------ peer frames

    def on_peer_frame(self, link: PeerLink, frame: Frame) -> None:
        """Dispatch one frame from a peer (runs on that link's receiver thread)."""
        m, t = frame.meta, frame.type
        if t == FrameType.HEARTBEAT:
            op = m.get("op")
            if op == "ping":
                link.send(Frame(FrameType.HEARTBEAT, {"op": "pong", "id": m.get("id")}))
                return
            if op == "pong":
                with self.lock:
                    slot = self.pings.get(m.get("id"))
                    if slot is not None:
                        slot.append(time.monotonic())
                        self.cv.notify_all()
                return
            link.done = int(m.get("done", link.done))
            link.state_round = _opt_int(m.get("state_round"))
            link.result_round = _opt_int(m.get("result_round"))
            self._on_progress()
        elif t == FrameType.ROUND:
            op = m.get("op")
            if op == "ready":
                self._on_ready(link.cluster, m)
            elif op == "start":
                self._on_decision(Decision.from_meta(m))
            elif op == "behind":
                with self.lock:
                    self.behind_rounds.add(int(m["round"]))
                    self.cv.notify_all()
            elif op == "abort":
                key = (int(m["round"]), int(m["attempt"]), str(m["coord"]))
                with self.lock:
                    ex = self.exchanges.get(key)
                if ex is not None:
                    ex.fail(f"{link.cluster} aborted: {m.get('reason')}")
            else:
                raise WireError(f"unknown ROUND op {op!r}")
        elif t == FrameType.PEER_CHUNK:
            if m.get("op") not in ("contrib", "avg"):
                raise WireError(f"unknown PEER_CHUNK op {m.get('op')!r}")
            self._on_chunk(link.cluster, frame)
        elif t == FrameType.STATE_REQUEST:
            what = m.get("op")
            if what not in ("result", "state"):
                raise WireError(f"unknown STATE_REQUEST op {what!r}")
            self._spawn(self._serve_request, link, m, name=f"relay-serve-{what}")
        elif t in (FrameType.RESULT, FrameType.STATE):
            with self.lock:
                fetch = self.fetches.get(m.get("req"))
            if fetch is None:
                return  # an answer nobody waits for any more
            fetch.on_frame(frame)
        else:
            raise WireError(f"unexpected {t.name} frame from a peer")

    def _on_progress(self) -> None:
        newest = self.newest_done()
        for round_id, clusters in self.coordinator.behind(newest):
            for c in clusters:
                self._tell_behind(c, round_id)
        with self.lock:
            self.cv.notify_all()

    def _tell_behind(self, cluster: str, round_id: int) -> None:
        if cluster == self.me:
            with self.lock:
                self.behind_rounds.add(round_id)
                self.cv.notify_all()
        else:
            self._send_to(cluster, Frame(FrameType.ROUND, {"op": "behind", "round": round_id}))

    def _on_ready(self, cluster: str, m: dict[str, Any]) -> None:
        res = self.coordinator.ready(
            int(m["round"]), int(m["attempt"]), cluster, ok=bool(m["ok"]), numel=int(m["numel"]),
            reason=str(m.get("reason", "")), now=time.monotonic(), newest_done=self.newest_done())
        if res == BEHIND:
            self._tell_behind(cluster, int(m["round"]))
        elif isinstance(res, Decision):
            self._announce(res)

    def _announce(self, d: Decision) -> None:
        """Send a decision to every connected peer and apply it here."""
        frame = Frame(FrameType.ROUND, {"op": "start", **d.to_meta()})
        for c in self.connected():
            self._send_to(c, frame)
        self._on_decision(d)

    def _on_decision(self, d: Decision) -> None:
        with self.lock:
            key = (d.round, d.coordinator)
            old = self.decisions.get(key)
            if old is None or d.attempt >= old.attempt:
                self.decisions[key] = d
            for k in [k for k in self.decisions if k[0] < d.round - 16]:
                del self.decisions[k]
            self.cv.notify_all()

    def _on_chunk(self, src: str, frame: Frame) -> None:
        m = frame.meta
        key = (int(m["round"]), int(m["attempt"]), str(m["coord"]))
        with self.lock:
            ex = self.exchanges.get(key)
            if ex is None:
                if key[0] > self.done_round:
                    self.early.setdefault(key, []).append((src, frame))
                return
        self._feed(ex, src, frame)

    def _feed(self, ex: RoundExchange, src: str, frame: Frame) -> None:
        m = frame.meta
        try:
            k = int(m["k"])
            if m.get("zero"):
                enc = None
            else:
                enc = Encoded.from_wire(m, frame.payload)
                if enc.codec != self.codec.name:
                    raise ExchangeError(f"chunk encoded with {enc.codec}, expected "
                                        f"{self.codec.name}")
            if m["op"] == "contrib":
                ex.add_contrib(src, k, enc)
            else:
                ex.add_avg(src, k, enc)
        except (ExchangeError, CodecError, KeyError, ValueError) as exc:
            log.warning("round %s: bad chunk from %s: %s", m.get("round"), src, exc)
            ex.fail(f"bad chunk from {src}: {exc}")

    # ------------------------------------------------------------------ serving peers

    def _serve_request(self, link: PeerLink, m: dict[str, Any]) -> None:
        req = m.get("req")
        try:
            if m["op"] == "result":
                round_id = int(m["round"])
                deadline = time.monotonic() + self.fetch_timeout
                with self.lock:
                    self.cv.wait_for(  # a round still being agreed or exchanged may finish
                        lambda: self.phase.get(round_id) not in ("agreeing", "exchanging")
                        or (self.result is not None and self.result[0] == round_id)
                        or time.monotonic() > deadline or link.closed,
                        self.fetch_timeout)
                    res = self.result
                if res is not None and res[0] == round_id:
                    frames = tensor_frames(
                        FrameType.RESULT, {"req": req, "status": "ok", "round": round_id,
                                           "present": res[1], "rejected": res[2]},
                        res[3], RESULT_CHUNK)
                else:
                    frames = [Frame(FrameType.RESULT, {"req": req, "status": "none"})]
            else:
                want = int(m.get("min_round", -1))
                wait = min(float(m.get("wait", 0)), self.fetch_timeout)
                with self.lock:
                    self.cv.wait_for(lambda: self.state is not None and self.state[0] >= want,
                                     wait)
                    st = self.state
                if st is None:
                    frames = [Frame(FrameType.STATE, {"req": req, "status": "none"})]
                else:
                    frames = tensor_frames(FrameType.STATE, {"req": req, "status": "ok",
                                                             "round": st[0]}, st[1], RESULT_CHUNK)
            for i, f in enumerate(frames):
                if i:
                    f.meta["req"] = req
                link.send(f, bulk=True)
        except LinkDown:
            pass
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("bad request from %s: %s", link.cluster, exc)

    def _request(self, cluster: str, meta: dict[str, Any], timeout: float) -> Fetch | None:
        """Ask a peer for a result or a state; the completed Fetch, or None."""
        with self.lock:
            link = self.links.get(cluster)
            if link is None:
                return None
            fetch = Fetch(next(self._req), link)
            self.fetches[fetch.req] = fetch
        try:
            link.send(Frame(FrameType.STATE_REQUEST, {**meta, "req": fetch.req}))
            ok = fetch.wait(timeout)
            if ok and fetch.meta and fetch.meta.get("status") == "ok" and fetch.tensor is not None:
                return fetch
            return None
        except LinkDown:
            return None
        finally:
            with self.lock:
                self.fetches.pop(fetch.req, None)

    def ping(self, cluster: str, timeout: float = 10.0) -> float:
        """Round-trip time (seconds) of a small frame to a peer and back, through the link."""
        req = next(self._req)
        with self.lock:
            self.pings[req] = []
        try:
            t0 = time.monotonic()
            if not self._send_to(cluster, Frame(FrameType.HEARTBEAT, {"op": "ping", "id": req})):
                raise LinkDown(f"no link to {cluster}")
            with self.lock:
                if not self.cv.wait_for(lambda: bool(self.pings[req]), timeout):
                    raise LinkDown(f"no pong from {cluster} within {timeout:g}s")
                return self.pings[req][0] - t0
        finally:
            with self.lock:
                self.pings.pop(req, None)

    # ------------------------------------------------------------------ local rounds

    def local_round(self, round_id: int, x: torch.Tensor) -> Outcome:
        """Run (or, for a retried request, return again) round ``round_id`` for this cluster."""
        with self.round_lock:
            cached = self.outcomes.get(round_id)
            if cached is not None:
                return cached
            t0 = time.monotonic()
            sent0, recv0 = self.wan_bytes()
            out = self._run_round(round_id, x, t0)
            sent1, recv1 = self.wan_bytes()
            out.seconds = time.monotonic() - t0
            out.bytes_sent, out.bytes_received = sent1 - sent0, recv1 - recv0
            self._finish_round(round_id, out)
            return out

    def _run_round(self, r: int, x: torch.Tensor, t0: float) -> Outcome:
        numel = x.numel()
        reason = self._check_contribution(x)
        if reason:
            self._event("round %d: local contribution rejected (%s); it is not sent", r, reason)
        with self.lock:
            self.cv.wait_for(lambda: len(self.ever_linked) == len(self.cfg.peers)
                             or time.monotonic() > self.started + STARTUP_GRACE
                             or self.stopping.is_set(),
                             max(0.0, self.started + STARTUP_GRACE - time.monotonic()))
        deadline = time.monotonic() + self.cfg.round_timeout
        if r <= self.newest_done():
            return self._catch_up(r, numel, "a peer has already completed this round")
        own = None if reason else OwnChunks(x, self.cfg.chunk_numel, self.cfg.block_size,
                                            self.codec, self.feedback)
        with self.lock:
            self.phase[r] = "agreeing"
        attempt = 0
        while True:
            t_agree = time.monotonic()
            d = self._agree(r, attempt, reason, numel, deadline)
            log.debug("round %d attempt %d: decision after %.3fs", r, attempt,
                      time.monotonic() - t_agree)
            if d == BEHIND:
                return self._catch_up(r, numel, "the coordinator says this round is over")
            if d is None:
                self._event("round %d: no decision from coordinator %s by the deadline", r,
                            self.coordinator_view())
                got = self._recover(r, [c for c in self.connected()], numel)
                if got is not None:
                    return got
                return self._alone(r, x if own else None, numel, reason)
            if self.me not in d.present or own is None:
                why = "late" if self.me in d.missing else "rejected"
                if not d.present:
                    self._event("round %d: this cluster was left out (%s) and nobody is "
                                "present; zero update", r, why)
                    return Outcome(torch.zeros(numel), [], r, list(d.rejected),
                                   list(d.missing), mode="empty")
                self._event("round %d: this cluster was left out (%s); fetching the average", r,
                            why)
                got = self._recover(r, list(d.present), numel, d)
                if got is not None:
                    return got
                return self._catch_up(r, numel, "no present peer could hand over the average")
            ex = self._exchange(d, own, numel)
            if ex.done:
                return Outcome(ex.result, list(d.present), r, sorted(set(d.rejected) |
                               ex.dropped), list(d.missing), mode=ex.schedule.mode)
            self._event("round %d attempt %d failed: %s", r, attempt, ex.error)
            got = self._recover(r, [c for c in d.present if c != self.me], numel, d)
            if got is not None:
                return got
            if own.error:
                reason, own = f"cannot encode: {own.error}", None
            attempt += 1
            if attempt >= MAX_ATTEMPTS:
                self._event("round %d: giving up after %d attempts; zero update", r, attempt)
                return Outcome(torch.zeros(numel), [], r, mode="failed")
            deadline = time.monotonic() + self.cfg.round_timeout

    def _check_contribution(self, x: torch.Tensor) -> str:
        if not x.numel():
            return ""
        lo, hi = float(x.amin()), float(x.amax())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return "non-finite values (NaN or inf)"
        limit = getattr(self.codec, "limit", math.inf)
        if max(-lo, hi) > limit:
            return f"values beyond the {self.codec.name} range (|x| <= {limit:g})"
        return ""

    def _decode(self, enc: Encoded) -> torch.Tensor:
        """The codec's decode; for "none" a view of the received buffer (no copy)."""
        if enc.codec == "none" and self.codec.name == "none" and not enc.meta:
            view = memoryview(enc.payload).cast("B")
            if view.nbytes != 4 * enc.numel:
                raise CodecError(f"none: payload of {view.nbytes} bytes for {enc.numel} elements")
            if enc.numel == 0:
                return torch.empty(0)
            with warnings.catch_warnings():  # read-only buffers (own chunks) are only read
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(view, dtype=torch.float32)
        return self.codec.decode(enc)

    def _agree(self, r: int, attempt: int, reason: str, numel: int,
               deadline: float) -> Decision | str | None:
        """READY to the coordinator; wait for its decision (or BEHIND); None on time-out."""
        give_up = deadline + self.grace
        sent_to = None
        meta = {"op": "ready", "round": r, "attempt": attempt, "ok": not reason, "numel": numel,
                "reason": reason}
        while True:
            with self.lock:
                d = self.decisions.get((r, sent_to)) if sent_to else None
                if d is not None and d.attempt >= attempt:
                    return d
                if r in self.behind_rounds:
                    return BEHIND
                coord = self.coordinator_view()
                if coord != sent_to:
                    sent_to = coord
                else:
                    now = time.monotonic()
                    if now >= give_up or self.stopping.is_set():
                        return None
                    self.cv.wait(min(give_up - now, 0.5))
                    continue
            if coord == self.me:
                self._on_ready(self.me, meta)
            elif not self._send_to(coord, Frame(FrameType.ROUND, meta)):
                sent_to = None
                time.sleep(0.05)

    def _exchange(self, d: Decision, own: OwnChunks, numel: int) -> RoundExchange:
        spans = chunk_spans(numel, self.cfg.chunk_numel, align=self.cfg.block_size)
        sched = Schedule(self.me, d.present, len(spans))
        key = d.key
        ex_ref: list[RoundExchange] = []

        def send(dest: str, kind: str, k: int, enc: Encoded | None) -> None:
            meta = {"op": kind, "round": d.round, "attempt": d.attempt, "coord": d.coordinator,
                    "k": k}
            if enc is None:
                frame = Frame(FrameType.PEER_CHUNK, {**meta, "zero": True})
            else:
                frame = Frame(FrameType.PEER_CHUNK, {**meta, **enc.wire_meta()}, enc.payload)
            if not self._send_to(dest, frame, bulk=True):
                ex_ref[0].fail(f"no link to {dest}")

        ex = RoundExchange(sched, spans, encode=self.codec.encode, decode=self._decode,
                           send=send)
        ex_ref.append(ex)
        with self.lock:
            self.exchanges[key] = ex
            self.phase[d.round] = "exchanging"
            early = self.early.pop(key, [])
            gone = [c for c in sched.others if c not in self.links]
        if gone:
            ex.fail(f"present peer(s) {gone} not connected")
        for src, frame in early:
            self._feed(ex, src, frame)
        t0 = time.monotonic()
        t_fed = t_done = t0
        try:
            for k in range(len(spans)):
                if ex.error is not None:
                    break
                ex.add_own(k, own.get(k, self.stall_timeout))
            t_fed = time.monotonic()
            while not ex.wait(0.5):
                if ex.error is not None:
                    break
                if self.stopping.is_set():
                    ex.fail("relay stopping")
                elif time.monotonic() - ex.progress_at > self.stall_timeout:
                    ex.fail(f"no progress for {self.stall_timeout:g}s")
            t_done = time.monotonic()
            if ex.done:  # our own chunks may still be on their way: the round ends when sent
                for c in sched.others:
                    with self.lock:
                        link = self.links.get(c)
                    if link is not None:
                        link.flush(self.stall_timeout)
        except ExchangeError as exc:
            ex.fail(str(exc))
        log.debug("round %d exchange (%s, %d chunks): own chunks fed %.3fs, complete %.3fs, "
                  "sent %.3fs", d.round, sched.mode, len(spans), t_fed - t0, t_done - t0,
                  time.monotonic() - t0)
        with self.lock:
            del self.exchanges[key]
            self.phase[d.round] = "done" if ex.done else "recovering"
            if ex.done:
                self.result = (d.round, list(d.present), sorted(set(d.rejected) | ex.dropped),
                               ex.result)
            self.cv.notify_all()
        if not ex.done:
            for c in sched.others:
                self._send_to(c, Frame(FrameType.ROUND, {
                    "op": "abort", "round": d.round, "attempt": d.attempt,
                    "coord": d.coordinator, "reason": ex.error}))
        elif ex.dropped or ex.zeroed:
            self._event("round %d: dropped non-finite chunks from %s, %d average chunk(s) zeroed",
                        d.round, sorted(ex.dropped), ex.zeroed)
        return ex

    def _recover(self, r: int, candidates: list[str], numel: int,
                 d: Decision | None = None) -> Outcome | None:
        """Fetch round ``r``'s average from a peer that completed it."""
        with self.lock:
            self.phase[r] = "recovering"
            self.cv.notify_all()
        for c in sorted(candidates, key=self.order.__getitem__):
            if c == self.me:
                continue
            fetch = self._request(c, {"op": "result", "round": r}, self.fetch_timeout)
            if fetch is None or fetch.tensor is None or fetch.tensor.numel() != numel:
                continue
            present = list(fetch.meta.get("present", [])) if fetch.meta else []
            rejected = list(fetch.meta.get("rejected", [])) if fetch.meta else []
            missing = sorted(set(self.cfg.clusters) - set(present) - set(rejected))
            with self.lock:
                self.result = (r, present, rejected, fetch.tensor)
            return Outcome(fetch.tensor, present, r, rejected, missing, mode="fetched")
        return None

    def _catch_up(self, r: int, numel: int, why: str) -> Outcome:
        """This cluster is behind: a peer's round-r average if one has it, else a global state."""
        self._event("round %d: this cluster is behind (%s); catching up", r, why)
        with self.lock:
            holders = [c for c, link in self.links.items() if link.result_round == r]
            if self.result is not None and self.result[0] == r:
                res = self.result
                return Outcome(res[3], res[1], r, res[2], mode="cached")
        got = self._recover(r, holders, numel)
        if got is not None:
            return got
        newest = self.newest_done()
        with self.lock:
            own = self.state
            sources = sorted(self.links.values(), key=lambda lk: -(lk.state_round or -1))
        best: tuple[int, torch.Tensor] | None = own
        for link in sources:
            if best is not None and best[0] >= newest:
                break
            fetch = self._request(link.cluster, {"op": "state", "min_round": newest,
                                                 "wait": self.cfg.round_timeout},
                                  self.fetch_timeout)
            if fetch is not None and fetch.meta and fetch.tensor is not None:
                rnd = int(fetch.meta["round"])
                if best is None or rnd > best[0]:
                    best = (rnd, fetch.tensor)
        if best is None:
            self._event("round %d: no global state available to catch up from; zero update", r)
            return Outcome(torch.zeros(numel), [], r, mode="failed")
        log.info("round %d: caught up to round %d from a published global state", r, best[0])
        return Outcome(torch.zeros(numel), [], best[0], global_state=best[1], mode="catch-up")

    def _alone(self, r: int, x: torch.Tensor | None, numel: int, reason: str) -> Outcome:
        others = [c for c in self.cfg.clusters if c != self.me]
        if x is None:
            return Outcome(torch.zeros(numel), [], r, [self.me], others, mode="alone")
        avg = self._decode(self.codec.encode(x))
        with self.lock:
            self.result = (r, [self.me], [], avg)
        return Outcome(avg, [self.me], r, [], others, mode="alone")

    def _finish_round(self, r: int, out: Outcome) -> None:
        with self.lock:
            self.done_round = max(self.done_round, out.round_id)
            self.outcomes = {k: v for k, v in self.outcomes.items() if k >= r - 1}
            self.outcomes[r] = out
            for key in [k for k in self.early if k[0] <= r]:
                del self.early[key]
            self.phase = {k: v for k, v in self.phase.items() if k > r - 8}
            self.phase[r] = "done"
            self.behind_rounds = {b for b in self.behind_rounds if b > r}
            self.stats["rounds"] += 1
            if out.missing:
                self.stats["missed"] += 1
            if out.rejected:
                self.stats["rejected"] += len(out.rejected)
            if len(out.present) < len(self.cfg.clusters):
                self.stats["partial_rounds"] += 1
            self.last = {"round": out.round_id, "round_s": round(out.seconds, 4),
                         "present": out.present, "missing": out.missing,
                         "rejected": out.rejected, "mode": out.mode}
            self.cv.notify_all()
        if out.missing:
            self._event("round %d: completed without %s (not ready by the deadline)", r,
                        ", ".join(out.missing))
        log.info("round %d done in %.2fs (%s): present %s, sent %d B, received %d B", r,
                 out.seconds, out.mode, out.present, out.bytes_sent, out.bytes_received)
        self._broadcast_progress()
        self._append_metrics(r, out)
        self._write_status()

    # ------------------------------------------------------------------ workers

    def _on_worker_socket(self, sock: socket.socket) -> None:
        try:
            tls, ident = wrap_server(sock, self.server_ctx, job_id=self.cfg.job_id,
                                     roles={"worker"}, cluster=self.me, timeout=HANDSHAKE_TIMEOUT)
        except PeerRejected:
            return
        with self.lock:
            self.workers.add(tls)
        try:
            self._serve_worker(tls, ident.name)
        except ConnectionClosed:
            pass
        except (OSError, WireError) as exc:
            if not self.stopping.is_set():
                log.warning("worker %s (%s): %s", ident.name, _peer_addr(tls), exc)
        finally:
            with self.lock:
                self.workers.discard(tls)
            tls.close()

    def _serve_worker(self, sock: ssl.SSLSocket, name: str) -> None:
        while not self.stopping.is_set():
            frame = recv_frame(sock)
            m, t = frame.meta, frame.type
            if t == FrameType.HELLO:
                send_frames(sock, [Frame(FrameType.WELCOME, {
                    "cluster": self.me, "clusters": self.cfg.clusters, "codec": self.codec.name,
                    "round_timeout": self.cfg.round_timeout, **self.progress_meta()})])
            elif t == FrameType.CONTRIB and m.get("op") == "allreduce":
                round_id = m.get("round")
                x = recv_tensor(sock, FrameType.CONTRIB, m.get("numel"))
                if not isinstance(round_id, int) or round_id < 0:
                    send_frames(sock, [Frame(FrameType.ERROR, {"reason": "bad round id"})])
                    continue
                out = self.local_round(round_id, x)
                meta = {"round_id": out.round_id, "present": out.present,
                        "rejected": out.rejected, "missing": out.missing,
                        "seconds": out.seconds, "bytes_sent": out.bytes_sent,
                        "bytes_received": out.bytes_received,
                        "has_state": out.global_state is not None, "mode": out.mode}
                frames = tensor_frames(FrameType.RESULT, meta, out.tensor)
                if out.global_state is not None:
                    frames += tensor_frames(FrameType.STATE, {"round": out.round_id},
                                            out.global_state)
                send_frames(sock, frames)
            elif t == FrameType.STATE and m.get("op") == "publish":
                round_id = m.get("round")
                x = recv_tensor(sock, FrameType.STATE, m.get("numel"))
                if not isinstance(round_id, int):
                    send_frames(sock, [Frame(FrameType.ERROR, {"reason": "bad round id"})])
                    continue
                with self.lock:
                    if self.state is None or round_id >= self.state[0]:
                        self.state = (round_id, x)
                    self.cv.notify_all()
                send_frames(sock, [Frame(FrameType.STATE, {"op": "stored", "round": round_id})])
                self._broadcast_progress()
            elif t == FrameType.STATE_REQUEST and m.get("op") == "fetch":
                st = self.best_state()
                if st is None:
                    send_frames(sock, [Frame(FrameType.STATE, {"op": "state", "round": None})])
                else:
                    send_frames(sock, tensor_frames(FrameType.STATE,
                                                    {"op": "state", "round": st[0]}, st[1]))
            elif t == FrameType.BYE:
                return
            else:
                send_frames(sock, [Frame(FrameType.ERROR, {
                    "reason": f"unexpected {t.name} frame {m.get('op', '')}"})])
                return

    def best_state(self) -> tuple[int, torch.Tensor] | None:
        """The newest global state held here or by a connected peer."""
        with self.lock:
            best = self.state
            sources = sorted(self.links.values(), key=lambda lk: -(lk.state_round or -1))
        for link in sources:
            if link.state_round is None or (best is not None and best[0] >= link.state_round):
                break
            fetch = self._request(link.cluster, {"op": "state", "min_round": link.state_round,
                                                 "wait": 0}, self.fetch_timeout)
            if fetch is not None and fetch.meta and fetch.tensor is not None:
                best = (int(fetch.meta["round"]), fetch.tensor)
        return best

    # ------------------------------------------------------------------ status and metrics

    def wan_bytes(self) -> tuple[int, int]:
        with self.lock:
            links = list(self.links.values())
            sent, recv = self.closed_bytes
        return (sent + sum(lk.bytes_sent for lk in links),
                recv + sum(lk.bytes_received for lk in links))

    def status(self, state: str = "running") -> dict[str, Any]:
        sent, recv = self.wan_bytes()
        with self.lock:
            peers = {c: {"connected": c in self.links,
                         "address": self.links[c].addr if c in self.links else self.cfg.peers[c],
                         "since": self.links[c].connected_at if c in self.links else None,
                         "round": self.links[c].done if c in self.links else None}
                     for c in self.cfg.peers}
            return {"job_id": self.cfg.job_id, "cluster": self.me, "pid": os.getpid(),
                    "state": state, "ts": time.time(), "round": self.done_round,
                    "peers": peers, "peers_connected": sorted(self.links),
                    "bytes_sent": sent, "bytes_received": recv,
                    "last_round_s": self.last.get("round_s"),
                    "present": self.last.get("present"), "missing": self.last.get("missing"),
                    "rejected": self.last.get("rejected"), **self.stats}

    def _write_status(self, state: str = "running") -> None:
        self._status_dirty.clear()
        path = self.cfg.status_file
        if not path:
            return
        try:
            _atomic_write(Path(path), json.dumps(self.status(state)) + "\n")
        except OSError as exc:
            log.warning("cannot write status file %s: %s", path, exc)

    def _append_metrics(self, r: int, out: Outcome) -> None:
        if not self.cfg.metrics_file:
            return
        sent, recv = self.wan_bytes()
        rec = {"ts": time.time(), "cluster": self.me, "round": out.round_id, "request_round": r,
               "round_s": round(out.seconds, 4), "bytes_sent": out.bytes_sent,
               "bytes_received": out.bytes_received, "bytes_sent_total": sent,
               "bytes_received_total": recv, "present": out.present, "missing": out.missing,
               "rejected": out.rejected, "mode": out.mode,
               "caught_up": out.global_state is not None}
        try:
            Path(self.cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            with open(self.cfg.metrics_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as exc:
            log.warning("cannot append to metrics file %s: %s", self.cfg.metrics_file, exc)

    def _tick_loop(self) -> None:
        while not self.stopping.is_set():
            silent = 3 * self.cfg.heartbeat
            for c in self.connected():
                with self.lock:
                    link = self.links.get(c)
                if link is not None and time.monotonic() - link.last_rx > silent:
                    link.close(f"no traffic for {silent:g}s")
            for d in self.coordinator.due(time.monotonic()):
                if d.missing or d.rejected:
                    log.info("round %d attempt %d decided: present %s, missing %s, rejected %s",
                             d.round, d.attempt, list(d.present), list(d.missing),
                             list(d.rejected))
                self._announce(d)
            if self._status_dirty.is_set():
                self._write_status()
            nxt = self.coordinator.next_deadline()
            wait = 0.2 if nxt is None else min(0.2, max(0.0, nxt - time.monotonic()))
            self.stopping.wait(wait)


# ---------------------------------------------------------------------- helpers


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _peer_addr(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "<unknown>"
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _refuse(sock: ssl.SSLSocket, reason: str) -> None:
    try:
        sock.settimeout(2.0)
        send_frames(sock, [Frame(FrameType.ERROR, {"reason": reason})])
    except (OSError, WireError):
        pass
    sock.close()


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run a relay until SIGTERM/SIGINT; 0 on a clean stop, 2 on a bad config."""
    parser = argparse.ArgumentParser(prog="python -m nebula_cli.relay.server",
                                     description="nebula gradient relay of one cluster")
    parser.add_argument("--config", required=True, help="path of relay.json")
    parser.add_argument("--log-level", default=os.environ.get("NEBULA_RELAY_LOG", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = RelayConfig.load(args.config)
        relay = Relay(cfg)
    except NebulaError as exc:
        log.error("%s", exc)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        relay.start()
    except NebulaError as exc:
        log.error("%s", exc)
        return 1
    try:
        while not stop.wait(0.5):
            pass
    finally:
        relay.stop()
    log.info("relay %s stopped", cfg.cluster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
