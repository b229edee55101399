"""The peer side of a relay's rounds: round control (READY, START, BEHIND, ABORT), chunks,
progress, links going up and down, and the coordinator's deadlines.

:class:`RoundControl` is one collaborator of the round driver
(:class:`nebula_cli.relay.protocol.rounds.Rounds` owns one): it is handed the rounds' shared
:class:`~nebula_cli.relay.protocol.round_state.RoundState` and the
:class:`~nebula_cli.relay.protocol.network.Net`, runs this relay's
:class:`~nebula_cli.relay.protocol.agreement.Coordinator`, keeps the decisions it saw (and
follows the codec and merge step the newest one names), and agrees each round for the driver
(:meth:`RoundControl.agree`: READY to the coordinator, then its decision).

Round control for a round too far ahead of this relay and its peers is not acted on at once:
after a resume every relay starts fresh (round -1) while the workers go on from their
checkpoint's round, so a peer's READY or START may come before this relay's own worker has said
which round it is at. The newest of those per peer (at most :data:`HELD_PER_PEER`) are held and
handled once this relay's worker asks for a round close enough (see :meth:`raise_floor`);
other control for rounds too far ahead is refused (logged), as chunks for them are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import Codec, CodecError
from nebula_cli.relay.codecs.chunks import chunk_spans
from nebula_cli.relay.net.limits import (
    MAX_OPEN_ROUNDS,
    MAX_ROUNDS_AHEAD,
    EarlyChunks,
    LimitExceeded,
    Refusals,
)
from nebula_cli.relay.protocol.agreement import BEHIND, Coordinator, Decision, Verdict
from nebula_cli.relay.protocol.allreduce import ExchangeError, RoundExchange
from nebula_cli.relay.protocol.messages import (
    MAX_ATTEMPTS,
    Abort,
    Behind,
    ChunkKind,
    PeerChunk,
    Ready,
    RoundMessage,
    round_frame,
)
from nebula_cli.relay.protocol.network import Net
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.round_state import RoundState

log = logging.getLogger("nebula.relay")

HELD_PER_PEER = 2
"""Round control frames held per peer for a round ahead of this relay's own worker."""


class RoundControl:
    """Round control with this relay's peers. ``codecs``: the codecs a round may use
    (``compression: auto``'s candidates, else one)."""

    def __init__(self, cfg: RelayConfig, codecs: Mapping[str, Codec], state: RoundState,
                 net: Net, *, refusals: Refusals, clock: Callable[[], float]) -> None:
        self.cfg, self.me, self.state, self.net = cfg, cfg.cluster, state, net
        self.codecs = dict(codecs)
        self.codec: Codec = next(iter(self.codecs.values()))
        """The codec of this relay's next round (with ``compression: auto``, as the newest
        decision said)."""
        self.codec_round = -1  # the round of the decision that set self.codec
        self.merge_in_force: int | None = None
        """Overlap: the merge step the newest decision this relay saw named (every outcome
        carries it, also one recovered without a decision of its own)."""
        self.merge_round = -1  # the round of the decision that set merge_in_force
        n = 1 << 20
        self.coordinator = Coordinator(
            self.me, cfg.clusters, cfg.round_timeout, cfg.auto_steps, cfg.auto_codec,
            {name: c.payload_nbytes(n) / n for name, c in self.codecs.items()})
        self.early = EarlyChunks(cfg.clusters, MAX_ATTEMPTS, size=PeerChunk.held_size)
        """Chunks that came before their round's exchange started here."""
        self.decisions: dict[tuple[int, str], Decision] = {}  # (round, coordinator) ->
        self.behind_rounds: set[int] = set()
        """Rounds some coordinator said are over (this relay catches up instead)."""
        self.floor = -1
        """The round before the newest one this relay's own worker asked for (-1: none yet)."""
        self.held: dict[str, list[RoundMessage]] = {}
        self._refusals = refusals
        self.clock = clock

    # ------------------------------------------------------------------ for the round driver

    def raise_floor(self, round_id: int) -> None:
        """This relay's worker asked for ``round_id``: handle what peers sent for it early."""
        with self.state.lock:
            self.floor = max(self.floor, round_id - 1)
            held, self.held = self.held, {}
        for src, frames in held.items():
            for m in frames:
                self.on_control(src, m)

    def in_force(self) -> tuple[Codec, int]:
        """The codec of this relay's next round and the round of the decision that named it
        (-1: none seen since this relay started)."""
        with self.state.lock:
            return self.codec, self.codec_round

    def agree(self, r: int, attempt: int, reason: str, numel: int, give_up: float,
              info: RoundInfo, codec: tuple[str, int]) -> Decision | Verdict | None:
        """READY for attempt ``attempt`` of round ``r`` to the coordinator (again to a new one
        when the coordinator changes); its decision, BEHIND, or None at ``give_up``."""
        sent_to = None
        ready = Ready(round=r, attempt=attempt, ok=not reason, numel=numel, reason=reason,
                      lineage=self.state.lineage_before(r), info=info,
                      codec=codec[0], codec_round=codec[1])
        state = self.state
        while True:
            with state.lock:
                d = self.decisions.get((r, sent_to)) if sent_to else None
                if d is not None and d.attempt >= attempt:
                    return d
                if r in self.behind_rounds:
                    return BEHIND
                coord = self.net.coordinator()
                if coord != sent_to:
                    sent_to = coord
                else:
                    now = self.clock()
                    if now >= give_up or state.stopping:
                        return None
                    state.cv.wait(min(give_up - now, 0.5))
                    continue
            if coord == self.me:
                self._on_ready(self.me, ready)
            elif not self.net.send(coord, round_frame(ready)):
                sent_to = None
                time.sleep(0.05)

    def feed(self, ex: RoundExchange, src: str, chunk: PeerChunk) -> None:
        """A peer's chunk for exchange ``ex`` (one that is not the sender's round is refused;
        a bad one fails the exchange)."""
        if src not in ex.schedule.present:  # not in this round: refused, the round goes on
            self._refusals.refuse("chunk", src, f"round {chunk.round} is not its round")
            return
        enc = chunk.enc
        try:
            if enc is not None and enc.codec != ex.codec:
                raise ExchangeError(f"chunk encoded with {enc.codec}, expected {ex.codec}")
            if chunk.kind == ChunkKind.CONTRIB:
                ex.add_contrib(src, chunk.k, enc)
            else:
                ex.add_avg(src, chunk.k, enc)
        except (ExchangeError, CodecError) as exc:
            log.warning("round %s: bad chunk from %s: %s", chunk.round, src, exc)
            ex.fail(f"bad chunk from {src}: {exc}")

    def round_done(self, r: int) -> None:
        """Round ``r`` is done here: forget its early chunks and what said it was over."""
        with self.state.lock:
            self.early.drop_through(r)
            self.behind_rounds = {b for b in self.behind_rounds if b > r}

    # ------------------------------------------------------------------ from peers

    def on_control(self, src: str, msg: RoundMessage) -> None:
        """Round control from peer ``src`` (decoded where its frame came in)."""
        r = msg.round
        newest = self._horizon()
        if not isinstance(msg, Abort) and r > newest + MAX_ROUNDS_AHEAD:
            if isinstance(msg, Ready | Decision):  # perhaps a resumed peer ahead of our worker
                with self.state.lock:
                    self.held[src] = [*self.held.get(src, []), msg][-HELD_PER_PEER:]
                return
            self._refusals.refuse("round control", src, f"behind for round {r}, this relay "
                                  f"and its peers are at round {newest}")
            return
        if isinstance(msg, Ready):
            self._on_ready(src, msg)
        elif isinstance(msg, Decision):
            if msg.coordinator != src:
                self._refusals.refuse("round control", src,
                                      f"a decision of {msg.coordinator} relayed by {src}")
                return
            self._on_decision(msg)
        elif isinstance(msg, Behind):
            with self.state.lock:
                self.behind_rounds = {b for b in self.behind_rounds
                                      if b > self.state.done_round - MAX_OPEN_ROUNDS} | {r}
                self.state.cv.notify_all()
        else:
            with self.state.lock:
                ex = self.state.exchanges.get(msg.key)
            if ex is not None:
                ex.fail(f"{src} aborted: {msg.reason}")

    def on_chunk(self, src: str, chunk: PeerChunk) -> None:
        """A chunk from ``src``: fed to its round's exchange, held briefly if that has not
        started yet (within limits), else refused."""
        key = chunk.key
        state = self.state
        with state.lock:
            ex = state.exchanges.get(key)
            if ex is None:
                numel = state.sync.numel if state.sync else None
                spans = 0 if numel is None else len(chunk_spans(
                    numel, self.cfg.chunk_numel, align=self.cfg.block_size))
                try:
                    done = max(state.done_round, self.floor)
                    self.early.add(key, src, chunk.k, chunk, done=done,
                                   sync_numel=numel, num_chunks=spans)
                except LimitExceeded as exc:
                    if key[0] > done:
                        self._refusals.refuse("chunk", src, str(exc))
                return
        self.feed(ex, src, chunk)

    def on_progress(self) -> None:
        """A peer's progress changed (or a link came up): close collections of rounds some
        relay has already completed, wake waiting rounds."""
        for round_id, clusters in self.coordinator.behind(self.state.newest_done(self.net)):
            for c in clusters:
                self._tell_behind(c, round_id)
        self._decide_without_the_gone()
        self.state.poke()

    def on_link_up(self) -> None:
        if self.net.coordinator() != self.me:
            self.coordinator.drop_open()  # the clusters waiting on it re-send READY
        self.on_progress()

    def on_link_down(self, cluster: str, reason: str) -> None:
        with self.state.lock:
            for ex in self.state.exchanges.values():
                if cluster in ex.schedule.present:
                    ex.fail(f"lost the link to {cluster}: {reason}")
            self.state.cv.notify_all()
        self._decide_without_the_gone()

    def tick(self) -> float | None:
        """Decide the rounds whose deadline passed; the next deadline (monotonic) or None."""
        for d in self.coordinator.due(self.clock()):
            if d.missing or d.rejected:
                log.info("round %d attempt %d decided: present %s, missing %s, rejected %s",
                         d.round, d.attempt, list(d.present), list(d.missing), list(d.rejected))
            self._announce(d)
        return self.coordinator.next_deadline()

    # ------------------------------------------------------------------ internals

    def _horizon(self) -> int:
        """The round control and chunks are measured against: this relay's and its peers'
        newest completed round, or the one before what its own worker asked for."""
        with self.state.lock:
            floor = self.floor
        return max(self.state.newest_done(self.net), floor)

    def _decide_without_the_gone(self) -> None:
        """As coordinator, decide the open rounds that wait only for peers that are gone or
        whose workers have finished."""
        if self.net.coordinator() == self.me:
            for d in self.coordinator.complete(self._reachable()):
                self._announce(d)

    def _reachable(self) -> list[str]:
        """The clusters that can still be ready for a round: this one and its connected
        peers whose workers have not finished."""
        done = {c for c, (finished, _, _) in self.net.finish_view().items()
                if finished is not None}
        with self.state.lock:
            if self.state.finished is not None:
                done.add(self.me)
        return [c for c in [self.me, *self.net.connected()] if c not in done]

    def _tell_behind(self, cluster: str, round_id: int) -> None:
        if cluster == self.me:
            with self.state.lock:
                self.behind_rounds.add(round_id)
                self.state.cv.notify_all()
        else:
            self.net.send(cluster, round_frame(Behind(round=round_id)))

    def _on_ready(self, cluster: str, m: Ready) -> None:
        res = self.coordinator.ready(
            m.round, m.attempt, cluster, ok=m.ok, numel=m.numel, reason=m.reason,
            now=self.clock(), newest_done=self.state.newest_done(self.net), lineage=m.lineage,
            expected=self._reachable(), info=m.info, codec=(m.codec, m.codec_round))
        if res == BEHIND:
            self._tell_behind(cluster, m.round)
        elif isinstance(res, Decision):
            self._announce(res)
        for d in self.coordinator.complete(self._reachable()):  # rounds ``cluster`` is past
            self._announce(d)

    def _announce(self, d: Decision) -> None:
        """Send a decision to every connected peer and apply it here."""
        frame = round_frame(d)
        for c in self.net.connected():
            self.net.send(c, frame)
        self._on_decision(d)

    def _on_decision(self, d: Decision) -> None:
        with self.state.lock:
            key = (d.round, d.coordinator)
            old = self.decisions.get(key)
            if old is None or d.attempt >= old.attempt:
                self.decisions[key] = d
            self._follow(d)
            newest = max(k[0] for k in self.decisions)
            for k in [k for k in self.decisions if k[0] <= newest - MAX_OPEN_ROUNDS]:
                del self.decisions[k]
            self.state.cv.notify_all()

    def _follow(self, d: Decision) -> None:
        """What the newest decision says of the next round (called with the lock held, for
        every decision this relay sees, its own or a peer's): with ``compression: auto`` its
        codec, with overlap its merge step."""
        nxt = d.next
        if d.round >= self.codec_round and nxt.codec in self.codecs:
            self.codec, self.codec_round = self.codecs[nxt.codec], d.round
        elif nxt.codec and nxt.codec not in self.codecs:
            log.warning("round %d: the decision names codec %r, not one of %s; ignored",
                        d.round, nxt.codec, sorted(self.codecs))
        if nxt.merge is not None and d.round >= self.merge_round:
            self.merge_in_force, self.merge_round = nxt.merge, d.round
