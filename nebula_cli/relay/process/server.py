"""The relay process of one cluster: :class:`Relay` builds its parts and wires them.

- :mod:`~nebula_cli.relay.net.peers`: listening, dialing, hello, the table of live links;
- :mod:`~nebula_cli.relay.net.link`: one peer link (duplex TLS, frame I/O, heartbeats);
- :mod:`~nebula_cli.relay.protocol.rounds`: the round driver (agreement, exchange, catch-up), which
  only sees the network through a small interface and opens no socket;
- :mod:`~nebula_cli.relay.protocol.fetch`: catch-up transfers (a round's average, a global state);
- :mod:`~nebula_cli.relay.process.worker_port`: the worker port (mutual TLS), and the Unix socket
  for workers on this host (:mod:`~nebula_cli.relay.net.local_socket`: uid checked, tensors in
  sealed shared memory);
- :mod:`~nebula_cli.relay.process.status`: the status file and metrics lines (one writer thread);
- :mod:`~nebula_cli.relay.net.limits`: every cap on what peers and workers can make it hold.

Frames on a peer link (:mod:`nebula_cli.relay.net.wire`):

- HELLO / WELCOME: cluster, job, protocol, codec, block_size, chunk_numel (must match),
  progress {done, state_round, result_round, sync (the size this relay syncs, or null)}.
- HEARTBEAT: progress; op ping / pong (round-trip time).
- ROUND: op ready / start / behind / abort (round agreement, no payload).
- PEER_CHUNK: op contrib / avg with one encoded chunk (round, attempt, coordinator, index).
- STATE_REQUEST: op result {round} or op state {min_round, wait}; answered with RESULT or
  STATE frames (a header, then fp32 chunks {req, lo}).
- ERROR (refusal, then close), BYE (orderly close).

Each frame is decoded where it comes in (:meth:`Relay._on_peer_frame`) into its typed message:
the link's own (:mod:`nebula_cli.relay.net.messages`) or the round protocol's
(:mod:`nebula_cli.relay.protocol.messages`); one that does not fit closes the link.

``python -m nebula_cli.relay --config relay.json`` (or ``python -m
nebula_cli.relay.process.server``) runs a relay until SIGTERM (exit 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.heap import HeapTrim
from nebula_cli.pki import CertPair, client_context, server_context
from nebula_cli.relay.codecs.registry import relay_codecs
from nebula_cli.relay.net import local_socket as local
from nebula_cli.relay.net.limits import Refusals, chunk_payload_cap
from nebula_cli.relay.net.link import PeerLink
from nebula_cli.relay.net.messages import Ping, Pong, RelayProgress, decode_heartbeat
from nebula_cli.relay.net.peers import PROTOCOL, Listener, Peers
from nebula_cli.relay.net.schema import encode
from nebula_cli.relay.net.wire import Frame, FrameType, WireError
from nebula_cli.relay.process.status import Status
from nebula_cli.relay.process.worker_messages import WorkerWelcome
from nebula_cli.relay.process.worker_port import WorkerPort
from nebula_cli.relay.protocol.fetch import Fetcher
from nebula_cli.relay.protocol.messages import (
    FetchRequest,
    PeerChunk,
    decode_answer,
    decode_fetch,
    decode_round,
)
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundOutcome
from nebula_cli.relay.protocol.rounds import Rounds

__all__ = ["PROTOCOL", "Relay", "main"]

log = logging.getLogger("nebula.relay")

ALL_DONE_LINGER = 30.0
"""Seconds a relay stays up once every cluster's workers have finished (late state requests,
a peer's last look) before it ends by itself."""


class _Net:
    """The network as the round driver sees it: the peer links, and fetches over them."""

    def __init__(self, peers: Peers, fetcher: Fetcher) -> None:
        self.peers, self.fetcher = peers, fetcher
        self.connected, self.coordinator = peers.connected, peers.coordinator
        self.peers_done, self.all_linked_once = peers.peers_done, peers.all_linked_once
        self.send, self.flush, self.holders = peers.send, peers.flush, peers.holders
        self.state_sources, self.wan_bytes = peers.state_sources, peers.wan_bytes
        self.finish_view, self.departed = peers.finish_view, peers.departed

    def fetch(self, cluster: str, ask: FetchRequest, timeout: float
              ) -> Average | GlobalState | None:
        link = self.peers.link(cluster)
        return None if link is None else self.fetcher.request(link, ask, timeout)


class Relay:
    """One cluster's relay: listeners, peer links, rounds, status. ``start()``/``stop()``."""

    def __init__(self, cfg: RelayConfig) -> None:
        self.cfg = cfg
        self.me = cfg.cluster
        self.codecs = relay_codecs(cfg)
        pair, ca = CertPair(Path(cfg.tls.cert), Path(cfg.tls.key)), Path(cfg.tls.ca)
        server_ctx = server_context(pair, ca)
        server_ctx.num_tickets = 0  # no post-handshake writes on the reader thread
        self.chunk_elems = max(cfg.block_size, cfg.chunk_numel - cfg.chunk_numel % cfg.block_size)
        self.stopping = threading.Event()
        self.ended = threading.Event()
        """Set once every cluster's workers have finished (for ``linger`` s): the relay's work
        is over, whoever looks at the job (its process then exits 0)."""
        self.linger = ALL_DONE_LINGER
        self.leaving = False
        """This cluster leaves the job for good (see config.parts.LEAVE_SIGNAL): the goodbye
        at ``stop()`` says so, and its peers do not wait for it at the end."""
        self.heap = HeapTrim()
        self._trim_due = threading.Event()
        self.refusals = Refusals()
        self.status = Status(cfg.status_file, cfg.metrics_file, self._view)
        self.peers = Peers(cfg, server_ctx, client_context(pair, ca),
                           hello=lambda: encode(self._progress()),
                           make_link=self._make_link, on_up=self._link_up,
                           on_down=self._link_down, refusals=self.refusals,
                           stopping=self.stopping)
        self.fetcher = Fetcher(sync_numel=self._sync_numel, chunk_elems=self.chunk_elems,
                               answer_result=self._answer_result,
                               answer_state=self._answer_state,
                               max_wait=max(120.0, 10 * cfg.round_timeout),
                               refusals=self.refusals)
        # averages in memory a worker on this host maps (no copy on the way back), used again
        shared = local.SharedPool() if cfg.worker_socket and local.supported() else None
        self.rounds = Rounds(cfg, self.codecs, _Net(self.peers, self.fetcher),
                             event=self.status.event, finished=self._finished,
                             refusals=self.refusals, empty=shared and shared.empty)
        self.workers = WorkerPort(self.me, cfg.job_id, server_ctx, self.rounds,
                                  welcome=self._welcome, published=self._broadcast_progress,
                                  refusals=self.refusals, stopping=self.stopping,
                                  shared=shared)
        self.listeners: list[Listener] = []
        self.local_socket: str | None = None
        """The Unix socket workers on this host use, once it listens."""
        self._ticker = threading.Thread(target=self._tick_loop, name="relay-tick", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind both listeners and start accepting, dialing and ticking."""
        try:
            for addr, handshake, name in (
                    (self.cfg.peer_listen, self._accept_peer, self.peers.admission_name),
                    (self.cfg.worker_listen, self.workers.handshake, None)):
                self.listeners.append(Listener(addr, handshake, self.refusals, self.stopping,
                                               name=name))
            self._listen_locally()
        except BaseException:
            self.stop()
            raise
        for ls in self.listeners:
            ls.start()
        self.peers.start_dialing()
        self._ticker.start()
        self.status.start()
        local = f" and {self.local_socket}" if self.local_socket else ""
        log.info(
            "relay %s of job %s: peers on %s, workers on %s%s, codec %s, dials %s", self.me,
            self.cfg.job_id, self.cfg.peer_listen, self.cfg.worker_listen, local,
            self.cfg.codec if not self.cfg.auto_codec else
            f"auto ({', '.join(self.codecs)})", self.cfg.dials or "nobody")

    def _listen_locally(self) -> None:
        """The Unix socket for workers on this host, when the plan has one and the system
        allows it; otherwise (logged) they use the TLS port."""
        path = self.cfg.worker_socket
        if path is None:
            return
        if not local.supported():
            log.warning("no local worker socket on this system (needs Linux); workers on "
                        "this host use the TLS port %s", self.cfg.worker_listen)
            return
        try:
            sock = local.listen(path)
        except local.LocalError as exc:
            log.warning("%s; workers on this host use the TLS port %s", exc,
                        self.cfg.worker_listen)
            return
        self.local_socket = path
        self.listeners.append(Listener(path, self.workers.local_handshake, self.refusals,
                                       self.stopping, sock=sock))

    def stop(self) -> None:
        """Close everything this relay opened; bounded waits."""
        self.stopping.set()
        for ls in self.listeners:
            ls.close()
        if self.local_socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.local_socket)
        self.rounds.stop()
        links = self.peers.stop(leaving=self.leaving or self.ended.is_set())
        self.workers.close_all()
        for link in links:
            link.join(2.0)
        for t in [self._ticker, *self.peers.threads, *(ls.thread for ls in self.listeners)]:
            if t.is_alive() and t is not threading.current_thread():
                t.join(2.0)
        self.status.stop()

    # ------------------------------------------------------------------ what tests and tools ask

    def connected(self) -> list[str]:
        return self.peers.connected()

    def ping(self, cluster: str, timeout: float = 10.0) -> float:
        return self.peers.ping(cluster, timeout)

    def snapshot(self) -> dict[str, Any]:
        """What the status file says now."""
        return self.status.snapshot()

    # ------------------------------------------------------------------ wiring

    def _sync_numel(self) -> int | None:
        sync = self.rounds.sync
        return None if sync is None else sync.numel

    def _progress(self) -> RelayProgress:
        return self.rounds.progress()

    def _welcome(self) -> WorkerWelcome:
        return WorkerWelcome(cluster=self.me, clusters=tuple(self.cfg.clusters),
                             codec=self.cfg.codec,
                             round_timeout=self.cfg.round_timeout, progress=self._progress())

    def _answer_result(self, round_id: int, wait: float, gone: Any) -> Average | None:
        return self.rounds.answer_result(round_id, wait, gone)

    def _answer_state(self, min_round: int, wait: float) -> GlobalState | None:
        return self.rounds.answer_state(min_round, wait)

    def _accept_peer(self, sock: Any, addr: str) -> None:
        self.peers.accept(sock, addr)

    def _make_link(self, cluster: str, sock: Any, progress: RelayProgress) -> PeerLink:
        return PeerLink(cluster, sock, progress, shaping=self.cfg.shaping,
                        heartbeat=self.cfg.heartbeat, on_frame=self._on_peer_frame,
                        on_close=self.peers.closed, beat=self._progress,
                        payload_cap=lambda: chunk_payload_cap(self.chunk_elems,
                                                              self._sync_numel()))

    def _link_up(self, link: PeerLink) -> None:
        self.rounds.on_link_up()
        self.status.touch()

    def _link_down(self, link: PeerLink, reason: str) -> None:
        self.fetcher.link_down(link)
        self.rounds.on_link_down(link.cluster, reason)
        if self.stopping.is_set():
            return
        if reason == "peer said goodbye":
            log.info("peer %s (%s) stopped", link.cluster, link.addr)
            self.status.touch()
        else:
            self.status.event("peer %s disconnected (%s): %s", link.cluster, link.addr, reason)

    def _on_peer_frame(self, link: PeerLink, frame: Frame) -> None:
        """Decode and dispatch one frame from a peer (runs on that link's receiver thread; a
        malformed one raises MessageError, and the link closes)."""
        t = frame.type
        if t == FrameType.HEARTBEAT:
            beat = decode_heartbeat(frame.meta)
            if isinstance(beat, Ping):
                link.send(Pong(id=beat.id).to_frame())
            elif isinstance(beat, Pong):
                self.peers.on_pong(beat.id)
            else:
                link.progress(beat)
                self.rounds.on_progress()
        elif t == FrameType.ROUND:
            self.rounds.on_control(link.cluster, decode_round(frame.meta))
        elif t == FrameType.PEER_CHUNK:
            self.rounds.on_chunk(link.cluster, PeerChunk.from_frame(frame))
        elif t == FrameType.STATE_REQUEST:
            self.fetcher.serve(link, decode_fetch(frame.meta))
        elif t in (FrameType.RESULT, FrameType.STATE):
            self.fetcher.on_answer(decode_answer(frame))
        else:
            raise WireError(f"unexpected {t.name} frame from a peer")

    def _broadcast_progress(self) -> None:
        self.peers.broadcast(Frame(FrameType.HEARTBEAT, encode(self._progress())))

    def _finished(self, r: int, out: RoundOutcome) -> None:
        self._broadcast_progress()
        self.status.record_round(r, out, len(self.cfg.clusters), self.peers.wan_bytes())
        self._trim_due.set()  # the ticker gives the round's freed memory back (nebula_cli.heap)

    def _view(self) -> dict[str, Any]:
        sent, recv = self.peers.wan_bytes()
        with self.peers.lock:
            links = dict(self.peers.links)
        peers = {c: {"connected": c in links,
                     "address": links[c].addr if c in links else self.cfg.peers[c],
                     "since": links[c].connected_at if c in links else None,
                     "round": links[c].done if c in links else None}
                 for c in self.cfg.peers}
        return {"job_id": self.cfg.job_id, "cluster": self.me,
                "round": self.rounds.done_round, "peers": peers,
                "peers_connected": sorted(links), "bytes_sent": sent, "bytes_received": recv,
                "refused": self.refusals.total,
                "sync": None if (sync := self.rounds.sync) is None else sync.to_meta()}

    def all_done(self) -> bool:
        """This cluster's workers and every other cluster's (all connected) have finished."""
        mine = self.rounds.finished_at()
        view = self.peers.finish_view()
        return mine is not None and set(view) == set(self.cfg.peers) and all(
            finished is not None for finished, _, _ in view.values())

    def _tick_loop(self) -> None:
        silent = self.cfg.dead_after
        done_since: float | None = None
        while not self.stopping.is_set():
            self.peers.close_silent(silent)
            if not self.all_done():
                done_since = None
            elif done_since is None:
                done_since = self.rounds.clock()
            elif self.rounds.clock() - done_since >= self.linger and not self.ended.is_set():
                log.info("every cluster's workers have finished: relay %s ends", self.me)
                self.ended.set()
            if self._trim_due.is_set() and self.heap.trim():  # due until one runs
                self._trim_due.clear()
            nxt = self.rounds.tick()
            wait = 0.2 if nxt is None else min(0.2, max(0.0, nxt - self.rounds.clock()))
            self.stopping.wait(wait)


def main(argv: list[str] | None = None) -> int:
    """``python -m nebula_cli.relay.process.server``: the same as ``python -m nebula_cli.relay``."""
    from nebula_cli.relay.__main__ import main as run

    return run(argv, prog="python -m nebula_cli.relay.process.server")


if __name__ == "__main__":
    raise SystemExit(main())
