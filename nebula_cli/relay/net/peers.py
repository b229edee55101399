"""Who this relay is connected to: listening, accepting and dialing peers, the hello, and the
table of live links (one per peer cluster; a newer connection replaces an older one).

The cluster listed *later* in ``clusters`` dials the earlier one (reconnecting with exponential
backoff, capped at BACKOFF_MAX), at its address or, through an SSH tunnel, at the tunnel's Unix
socket (a process of this relay's own user serves it, checked before a byte). Peers must
present a relay certificate of this job for a cluster that dials this relay, and a HELLO whose
protocol, job, codec, block size and chunk size match. A listener holds at most MAX_HANDSHAKES
connections between accept and the end of their hello, MAX_HANDSHAKES_PER_ADDRESS from one
address (an IPv6 /64), each for at most HANDSHAKE_TIMEOUT seconds and FIRST_BYTES_TIMEOUT until
its first byte; to make room, the oldest silent pending one of its address, or of the address
holding the most in the network holding the most, is ended and logged; one whose first bytes
arrived only for a newcomer of a network holding at least two fewer; a new one is refused when
none can be ended (:mod:`nebula_cli.relay.net.admission`). A link silent for `dead_after`
seconds is closed.

The HELLO and the WELCOME each offer a key for the AES-GCM records the link then uses instead
of TLS (:mod:`nebula_cli.relay.net.gcm_records`); when both offered one, both ends close TLS and go
on with records on the same connection, else the link stays on TLS.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_cli.config.relay_config import RelayConfig, parse_addr
from nebula_cli.errors import NebulaError
from nebula_cli.pki import PeerRejected, admission_name, wrap_client, wrap_server
from nebula_cli.relay.net import gcm_records as records
from nebula_cli.relay.net import local_socket
from nebula_cli.relay.net.admission import Admission, Pending, first_bytes
from nebula_cli.relay.net.framing import send_frames
from nebula_cli.relay.net.limits import (
    HANDSHAKE_TIMEOUT,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_ADDRESS,
    Refusals,
)
from nebula_cli.relay.net.link import LinkConn, LinkDown, PeerLink, peer_addr, refuse
from nebula_cli.relay.net.listen import listen_tcp
from nebula_cli.relay.net.messages import Goodbye, PeerHello, Ping, Refusal, RelayProgress
from nebula_cli.relay.net.schema import MessageError, decode
from nebula_cli.relay.net.wire import Frame, FrameType, WireError, recv_frame, tune_socket

log = logging.getLogger("nebula.relay")

PROTOCOL = 2  # 2: round control in ROUND frames, sync size in HELLO
BACKOFF_MAX = 5.0
COMPATIBLE = ("protocol", "job_id", "codec", "chunk_numel")
"""HELLO keys two relays must agree on, besides every codec's knobs (`CodecParamSet.handshake`:
the codecs say what of theirs must match)."""


class Listener:
    """A listening socket (TCP on ``addr``, or the given ``sock``: the local Unix socket) whose
    connections are handed to ``handshake(sock, addr)`` on a thread each, at most
    MAX_HANDSHAKES pending at once (the module's docstring says which ends when more come);
    ``handshake`` returns what to run once the slot is given back (a worker's session), or
    None."""

    def __init__(self, addr: str, handshake: Callable[[socket.socket, str],
                                                      Callable[[], None] | None],
                 refusals: Refusals, stopping: threading.Event, *,
                 sock: socket.socket | None = None, name: str | None = None) -> None:
        if sock is None:
            sock = listen_tcp(*parse_addr(addr), backlog=64, stopping=stopping)
        self.sock = sock
        self.sock.settimeout(0.5)
        self.addr = addr
        self._handshake, self._refusals, self._stopping = handshake, refusals, stopping
        self.admission = Admission(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_ADDRESS,
                                   HANDSHAKE_TIMEOUT, name=name)
        self.thread = threading.Thread(target=self._loop, name=f"relay-accept-{addr}",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
        self.sock.close()
        self.admission.close()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, where = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.1)
                continue
            tcp = isinstance(where, tuple)
            entry, ended = self.admission.admit(sock, str(where[0]) if tcp else "local")
            for old in ended:  # one line per address, not port
                self._refusals.refuse("connection", old.key,
                                      f"{self.admission.held} handshakes in progress on "
                                      f"{self.addr} (at most {MAX_HANDSHAKES}, "
                                      f"{MAX_HANDSHAKES_PER_ADDRESS} per address): its oldest "
                                      "silent pending connection was ended")
            if entry.ended is not None:
                self._refusals.refuse("connection", entry.key,
                                      f"every pending connection that could make room on "
                                      f"{self.addr} has sent its first bytes: the new one "
                                      "was closed")
                sock.close()
                continue
            sock.settimeout(None)
            tune_socket(sock)
            threading.Thread(target=self._run, args=(sock, entry, tcp), name="relay-conn",
                             daemon=True).start()

    def _run(self, sock: socket.socket, entry: Pending, tcp: bool) -> None:
        try:
            if tcp and not first_bytes(sock):  # a TLS client speaks first; AF_UNIX: the
                sock.close()                   # peer's uid is checked before anything is read
                return
            self.admission.spoke(entry)
            then = self._handshake(sock, peer_addr(sock))
        finally:
            self.admission.release(entry)
        if then is not None:
            then()


def _connect(where: str) -> socket.socket:
    """A connection to a peer's relay at `where`: host:port, or the path of a Unix socket (an
    SSH tunnel's local end; served by a process of this user's, else PermissionError)."""
    if os.path.isabs(where):
        return local_socket.connect(where, HANDSHAKE_TIMEOUT).sock
    raw = socket.create_connection(parse_addr(where), timeout=HANDSHAKE_TIMEOUT)
    tune_socket(raw)
    return raw


class Peers:
    """The live peer links of one relay. ``hello()`` is this relay's progress for its HELLO
    and WELCOME; ``make_link(cluster, sock, progress)`` builds a link wired to the relay (the
    peer's progress as its hello said); ``on_up(link)`` / ``on_down(link, reason)`` run
    (outside any lock) when the current link of a cluster changes."""

    def __init__(self, cfg: RelayConfig, server_ctx: ssl.SSLContext,
                 client_ctx: ssl.SSLContext, *, hello: Callable[[], dict[str, Any]],
                 make_link: Callable[[str, LinkConn, RelayProgress], PeerLink],
                 on_up: Callable[[PeerLink], None], on_down: Callable[[PeerLink, str], None],
                 refusals: Refusals, stopping: threading.Event) -> None:
        self.cfg, self.me = cfg, cfg.cluster
        self.server_ctx, self.client_ctx = server_ctx, client_ctx
        self.admission_name = admission_name(Path(cfg.tls.ca))
        """What this relay's ClientHellos name, and its peer port keeps slots for."""
        self._hello, self._make_link = hello, make_link
        self._on_up, self._on_down = on_up, on_down
        self.refusals, self.stopping = refusals, stopping
        self.order = {c: i for i, c in enumerate(cfg.clusters)}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.links: dict[str, PeerLink] = {}
        self.ever_linked: set[str] = set()
        self._departed: set[str] = set()  # peers whose relay said it left the job
        self.closed_bytes = [0, 0]  # bytes of links that are gone
        self.pings: dict[int, list[float]] = {}
        self._ids = itertools.count(1)
        self.threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ connecting

    def hello_meta(self) -> dict[str, Any]:
        return {"role": "relay", "cluster": self.me, "job_id": self.cfg.job_id,
                "protocol": PROTOCOL, "codec": self.cfg.codec,
                "chunk_numel": self.cfg.chunk_numel, **self.cfg.codec_params.handshake(),
                **self._hello()}

    def incompatible(self, meta: dict[str, Any]) -> str | None:
        mine = self.hello_meta()
        for key in (*COMPATIBLE, *self.cfg.codec_params.handshake()):
            if meta.get(key) != mine[key]:
                return f"{key} {meta.get(key)!r} differs from this relay's {mine[key]!r}"
        return None

    def start_dialing(self) -> None:
        for peer in self.cfg.dials:
            t = threading.Thread(target=self._dial_loop, args=(peer,),
                                 name=f"relay-dial-{peer}", daemon=True)
            t.start()
            self.threads.append(t)

    def accept(self, sock: socket.socket, addr: str) -> None:
        """A connection on the peer port: TLS, certificate, HELLO, then a link."""
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
                refuse(tls, f"cluster {ident.cluster} {why}")
                return
            tls.settimeout(HANDSHAKE_TIMEOUT)
            frame = recv_frame(tls, max_payload=0)
            reason = (f"expected HELLO, got {frame.type.name}" if frame.type != FrameType.HELLO
                      else self.incompatible(frame.meta))
            hello = None
            if reason is None:
                try:
                    hello = decode(PeerHello, frame.meta)
                except MessageError as exc:
                    reason = str(exc)
            if hello is None or hello.cluster != ident.cluster:
                reason = reason or "HELLO names another cluster than its certificate"
                log.warning("refused peer %s (%s): %s", addr, ident.cluster, reason)
                refuse(tls, reason)
                return
            welcome = self.hello_meta()
            peer_key = records.accepted(hello.records)
            if peer_key is not None:
                key, welcome["records"] = records.offer()
            send_frames(tls, [Frame(FrameType.WELCOME, welcome)])
            conn: LinkConn = tls if peer_key is None else records.RecordConn(
                records.unwrap(tls), key, peer_key)
        except (OSError, WireError) as exc:
            log.warning("peer %s (%s) lost during hello: %s", addr, ident.cluster, exc)
            tls.close()
            return
        self._add(ident.cluster, conn, hello.progress)

    def _dial_loop(self, peer: str) -> None:
        delay, failures = 0.1, 0
        while not self.stopping.is_set():
            with self.lock:
                link = self.links.get(peer)
                if link is not None and not link.closed:
                    self.changed.wait(1.0)
                    continue
            try:
                raw = _connect(self.cfg.peers[peer])
                tls, _ = wrap_client(raw, self.client_ctx, job_id=self.cfg.job_id,
                                     roles={"relay"}, cluster=peer, timeout=HANDSHAKE_TIMEOUT,
                                     server_name=self.admission_name)
                try:
                    tls.settimeout(HANDSHAKE_TIMEOUT)
                    key, offer = records.offer()
                    send_frames(tls, [Frame(FrameType.HELLO, {**self.hello_meta(),
                                                              "records": offer})])
                    frame = recv_frame(tls, max_payload=0)
                    if frame.type == FrameType.ERROR:
                        raise NebulaError(f"refused: {Refusal.read(frame.meta).reason}")
                    if frame.type != FrameType.WELCOME:
                        raise WireError(f"expected WELCOME, got {frame.type.name}")
                    reason = self.incompatible(frame.meta)
                    if reason:
                        raise NebulaError(reason)
                    welcome = decode(PeerHello, frame.meta, what="WELCOME")
                    offered = welcome.records
                    peer_key = records.accepted(offered)
                    if offered is not None and peer_key is None:  # it unwraps; we cannot
                        raise NebulaError(f"peer offered records this relay cannot use "
                                          f"({records.describe(offered)})")
                    conn: LinkConn = tls if peer_key is None else records.RecordConn(
                        records.unwrap(tls), key, peer_key)
                except BaseException:
                    tls.close()
                    raise
                self._add(peer, conn, welcome.progress)
                delay, failures = 0.1, 0
            except (OSError, NebulaError) as exc:
                failures += 1
                loud = failures in (1, 10) or failures % 100 == 0
                log.log(logging.WARNING if loud else logging.DEBUG,
                        "cannot reach peer %s at %s (attempt %d): %s; retrying in %.1fs",
                        peer, self.cfg.peers[peer], failures, exc, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _add(self, cluster: str, conn: LinkConn, progress: RelayProgress) -> None:
        link = self._make_link(cluster, conn, progress)
        with self.lock:
            if self.stopping.is_set():
                conn.close()
                return
            old = self.links.get(cluster)
            self.links[cluster] = link
            self.ever_linked.add(cluster)
            self._departed.discard(cluster)
            self.changed.notify_all()
        if old is not None:
            old.close("replaced by a new connection")
        link.start()
        log.info("peer %s connected (%s, %s); its round %d", cluster, link.addr,
                 "AES-GCM records" if link.records else "TLS", link.done)
        self._on_up(link)

    def closed(self, link: PeerLink, reason: str) -> None:
        """A link closed (called once per link)."""
        with self.lock:
            self.closed_bytes[0] += link.bytes_sent
            self.closed_bytes[1] += link.bytes_received
            link.bytes_sent = link.bytes_received = 0
            current = self.links.get(link.cluster) is link
            if current:
                del self.links[link.cluster]
                if link.left_job:
                    self._departed.add(link.cluster)
            self.changed.notify_all()
        if current:
            self._on_down(link, reason)

    # ------------------------------------------------------------------ who is there

    def link(self, cluster: str) -> PeerLink | None:
        with self.lock:
            return self.links.get(cluster)

    def connected(self) -> list[str]:
        with self.lock:
            return sorted(self.links, key=self.order.__getitem__)

    def coordinator(self) -> str:
        with self.lock:
            return min([self.me, *self.links], key=self.order.__getitem__)

    def peers_done(self) -> int:
        with self.lock:
            return max([-1, *(link.done for link in self.links.values())])

    def all_linked_once(self) -> bool:
        with self.lock:
            return len(self.ever_linked) == len(self.cfg.peers)

    def holders(self, round_id: int) -> list[str]:
        with self.lock:
            return [c for c, lk in self.links.items() if lk.result_round == round_id]

    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]:
        """Connected peers: (round their workers finished at or None, lineage, newest round)."""
        with self.lock:
            return {c: (lk.finished, lk.lineage, lk.done) for c, lk in self.links.items()}

    def departed(self) -> frozenset[str]:
        """Peers not connected whose relay said, as it went, that its cluster left the job."""
        with self.lock:
            return frozenset(self._departed)

    def state_sources(self) -> list[tuple[str, int | None]]:
        with self.lock:
            links = sorted(self.links.values(), key=lambda lk: -(lk.state_round or -1))
            return [(lk.cluster, lk.state_round) for lk in links]

    def send(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
        link = self.link(cluster)
        if link is None:
            return False
        try:
            link.send(frame, bulk=bulk)
            return True
        except LinkDown:
            return False

    def flush(self, cluster: str, timeout: float) -> None:
        link = self.link(cluster)
        if link is not None:
            link.flush(timeout)

    def broadcast(self, frame: Frame) -> None:
        for c in self.connected():
            self.send(c, frame)

    def wan_bytes(self) -> tuple[int, int]:
        with self.lock:
            links = list(self.links.values())
            sent, recv = self.closed_bytes
        return (sent + sum(lk.bytes_sent for lk in links),
                recv + sum(lk.bytes_received for lk in links))

    def close_silent(self, silent: float) -> None:
        """Close every link that received nothing for ``silent`` seconds."""
        with self.lock:
            links = list(self.links.values())
        for link in links:
            if time.monotonic() - link.last_rx > silent:
                link.close(f"no traffic for {silent:g}s")

    # ------------------------------------------------------------------ round trips

    def on_pong(self, ping_id: int) -> None:
        with self.lock:
            slot = self.pings.get(ping_id)
            if slot is not None:
                slot.append(time.monotonic())
                self.changed.notify_all()

    def ping(self, cluster: str, timeout: float = 10.0) -> float:
        """Round-trip time (seconds) of a small frame to a peer and back, through the link."""
        req = next(self._ids)
        with self.lock:
            self.pings[req] = []
        try:
            t0 = time.monotonic()
            if not self.send(cluster, Ping(id=req).to_frame()):
                raise LinkDown(f"no link to {cluster}")
            with self.lock:
                if not self.changed.wait_for(lambda: bool(self.pings[req]), timeout):
                    raise LinkDown(f"no pong from {cluster} within {timeout:g}s")
                return self.pings[req][0] - t0
        finally:
            with self.lock:
                self.pings.pop(req, None)

    def stop(self, leaving: bool = False) -> list[PeerLink]:
        """Say goodbye on every link (``leaving``: this cluster left the job for good) and
        close them; the links, to join."""
        with self.lock:
            links = list(self.links.values())
            self.changed.notify_all()
        for link in links:
            with contextlib.suppress(LinkDown):
                link.send(Goodbye(leaving=leaving).to_frame())
        time.sleep(0.05 if links else 0)
        for link in links:
            link.close("relay stopping")
        return links
