"""The round driver of one relay: agreement, exchange, recovery and catch-up, over a
:class:`Net` it is handed (the relay's peer links, or an in-memory network in tests): this
module opens no socket and starts no thread but the contribution's encoder.

A round (see :mod:`nebula_cli.relay.protocol.allreduce` for the schedule):

1. The worker's fp32 contribution for round ``r`` arrives (:meth:`Rounds.local_round`); the
   deadline is ``round_timeout`` from now. A non-finite contribution is rejected (never sent).
2. If a peer has already completed round ``r`` this cluster is *behind*: it gets round ``r``'s
   average from a peer that has it, else a peer's published global state.
3. Otherwise READY(r) goes to the coordinator (the first cluster in the job's order among this
   relay and its connected peers), which answers START(r, present, rejected, missing) once
   every cluster is ready or its deadline passed (or BEHIND).
4. The present relays exchange encoded chunks while the contribution is still being encoded;
   results are bit-identical on every relay.
5. A cluster left out (late, or rejected) gets the round's average from a present peer; if
   nobody is present it gets zeros. A cluster whose global state diverged from the others'
   (its READY carries its lineage, see :mod:`nebula_cli.relay.protocol.lineage`) takes a present
   peer's published global state instead (:mod:`nebula_cli.relay.protocol.recovery`). If a present
   peer disappears mid-exchange, the survivors fetch the result from one that completed, else
   redo the round (at most MAX_ATTEMPTS, then a zero delta). With no peer reachable at all a
   cluster averages alone.

Round control (ROUND frames, op ready/start/behind/abort) and chunks (PEER_CHUNK) from peers
come in through :meth:`Rounds.on_control` and :meth:`Rounds.on_chunk`; anything for a round
too far ahead, a decision a peer did not make, or an early chunk beyond what the sync size
allows is refused (logged, never held).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import Codec, Encoded
from nebula_cli.relay.codecs.chunks import chunk_spans
from nebula_cli.relay.codecs.contribution import OwnChunks, check_contribution, decode
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.net.limits import (
    EarlyChunks,
    Refusals,
    SyncSize,
)
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.agreement import BEHIND, Coordinator, Decision
from nebula_cli.relay.protocol.allreduce import (
    DIRECT,
    SHARD,
    ExchangeError,
    RoundExchange,
    Schedule,
)
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundOutcome
from nebula_cli.relay.protocol.round_control import MAX_ATTEMPTS, RoundControl
from nebula_cli.relay.protocol.round_state import EMPTY, EXCHANGE, RESYNC, after_decision

log = logging.getLogger("nebula.relay")

STARTUP_GRACE = 6.0
"""After a (re)start, a round waits up to this long (from the start) for peers that have not
been connected yet, so that a restarted relay learns how far its peers are first."""


class Net(Protocol):
    """What the round driver needs of the network (implemented by the relay's peers)."""

    def connected(self) -> list[str]: ...
    def coordinator(self) -> str: ...
    def peers_done(self) -> int: ...
    def all_linked_once(self) -> bool: ...
    def send(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool: ...
    def flush(self, cluster: str, timeout: float) -> None: ...
    def fetch(self, cluster: str, meta: dict[str, Any], timeout: float
              ) -> Average | GlobalState | None: ...
    def holders(self, round_id: int) -> list[str]: ...
    def state_sources(self) -> list[tuple[str, int | None]]: ...
    def wan_bytes(self) -> tuple[int, int]: ...
    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]: ...


class Rounds(RoundControl):
    """One relay's rounds. ``event(msg, *args)`` reports a warning-worthy event;
    ``finished(request_round, outcome)`` runs after each round."""

    def __init__(self, cfg: RelayConfig, codecs: Mapping[str, Codec], net: Net, *,
                 event: Callable[..., None], finished: Callable[[int, RoundOutcome], None],
                 refusals: Refusals, clock: Callable[[], float] = time.monotonic,
                 empty: Callable[[int], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.cfg, self.me, self.net = cfg, cfg.cluster, net
        self.codecs = dict(codecs)
        """The codecs a round may use (``compression: auto``'s candidates, else one)."""
        self.codec: Codec = next(iter(self.codecs.values()))
        """The codec of this relay's next round (with ``compression: auto``, as the newest
        decision said)."""
        self.codec_round = -1  # the round of the decision that set self.codec
        self.merge_in_force: int | None = None
        self.merge_round = -1  # the round of the decision that set merge_in_force
        self.prev_exchanged = False  # this relay's previous round was an exchange with peers
        self.prev_codec: str | None = None  # the codec of this relay's previous round
        self.empty = empty  # makes a round's average (None: torch.empty)
        self.feedback = ErrorFeedback(self.codec) if cfg.error_feedback else None
        self.order = {c: i for i, c in enumerate(cfg.clusters)}
        n = 1 << 20
        self.coordinator = Coordinator(
            self.me, cfg.clusters, cfg.round_timeout, cfg.auto_steps, cfg.auto_codec,
            {name: c.payload_nbytes(n) / n for name, c in self.codecs.items()})
        self.grace = max(2.0, 2 * cfg.heartbeat)
        self.fetch_timeout = max(120.0, 10 * cfg.round_timeout)
        self.stall_timeout = max(30.0, 3 * cfg.round_timeout)
        self.final_stall = max(600.0, 10 * cfg.round_timeout)
        """At the end, how long a cluster waits for peers that make no round at all."""
        self.early = EarlyChunks(cfg.clusters, MAX_ATTEMPTS)
        self._event, self._finished, self._refusals = event, finished, refusals
        self.clock = clock
        self.started = clock()
        self.floor = -1
        self.held: dict[str, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------------ the worker's round

    def local_round(self, round_id: int, x: torch.Tensor,
                    info: RoundInfo | None = None) -> RoundOutcome:
        """Run (or, for a retried request, return again) round ``round_id`` for this cluster;
        ``info``: what the worker said of its round (relay.cadence). The first contribution
        registers the sync size if the worker did not."""
        if self.sync is None:
            self.register(SyncSize.flat(x.numel()))
        self.raise_floor(round_id)
        with self.lock:
            self.finished = None  # a worker that said goodbye came back (restarted)
        with self.round_lock:
            cached = self.outcomes.get(round_id)
            if cached is not None:
                return cached
            t0 = self.clock()
            sent0, recv0 = self.net.wan_bytes()
            with self.lock:
                codec, known = self.codec, self.codec_round
            info = info or RoundInfo()  # an arrival after a fetch or alone is not a round's
            info = dataclasses.replace(info, codec=self.prev_codec,
                                       arrive_s=info.arrive_s if self.prev_exchanged else None)
            out = self._run_round(round_id, x, info, codec, known)
            out.codec = out.codec or codec.name  # averages carry theirs; the rest apply none
            with self.lock:
                out.next_merge = out.next_merge or self.merge_in_force
            self.prev_codec = out.codec
            self.prev_exchanged = out.mode in (DIRECT, SHARD) and out.global_state is None
            sent1, recv1 = self.net.wan_bytes()
            out.seconds = self.clock() - t0
            out.bytes_sent, out.bytes_received = sent1 - sent0, recv1 - recv0
            self._finish_round(round_id, out)
            return out

    def _run_round(self, r: int, x: torch.Tensor, info: RoundInfo, codec: Codec,
                   known: int) -> RoundOutcome:
        """``known``: the round whose decision named ``codec`` (-1: none seen since start)."""
        numel = x.numel()
        reason = check_contribution(x, codec)
        if reason:
            self._event("round %d: local contribution rejected (%s); it is not sent", r, reason)
        with self.lock:
            self.cv.wait_for(lambda: self.net.all_linked_once()
                             or self.clock() > self.started + STARTUP_GRACE
                             or self.stopping, max(0.0, self.started + STARTUP_GRACE
                                                   - self.clock()))
        deadline = self.clock() + self.cfg.round_timeout
        if r <= self.newest_done():
            return self._catch_up(r, numel, "a peer has already completed this round")
        own = None if reason else OwnChunks(x, self.cfg.chunk_numel, self.cfg.block_size,
                                            codec, self.feedback)
        self.set_phase(r, "agreeing")
        attempt = 0
        while True:
            d = self._agree(r, attempt, reason, numel, deadline, info, (codec.name, known))
            if d == BEHIND:
                return self._catch_up(r, numel, "the coordinator says this round is over")
            if not isinstance(d, Decision):
                self._event("round %d: no decision from coordinator %s by the deadline", r,
                            self.net.coordinator())
                got = self._recover(r, self.net.connected(), numel)
                if got is not None:
                    return got
                return self._alone(r, x if own else None, numel, codec)
            step = after_decision(self.me, d, own_ok=own is not None)
            if step == RESYNC:
                return self._resync(r, list(d.present), numel)
            if step != EXCHANGE:
                why = "late" if self.me in d.missing else "rejected"
                if step == EMPTY:
                    self._event("round %d: this cluster was left out (%s) and nobody is "
                                "present; zero update", r, why)
                    return RoundOutcome(torch.zeros(numel), [], r, list(d.rejected),
                                   list(d.missing), mode="empty")
                self._event("round %d: this cluster was left out (%s); fetching the average", r,
                            why)
                got = self._recover(r, list(d.present), numel)
                if got is not None:
                    return got
                return self._catch_up(r, numel, "no present peer could hand over the average")
            assert own is not None
            ex = self._exchange(d, own, numel, codec)
            if ex.done:
                return RoundOutcome(ex.result, list(d.present), r, sorted(set(d.rejected) |
                               ex.dropped), list(d.missing), mode=ex.schedule.mode,
                               weights=dict(d.weights), next_h=d.next_h,
                               next_h_why=d.why, codec=codec.name, next_codec=d.next_codec,
                               next_merge=d.next_merge)
            self._event("round %d attempt %d failed: %s", r, attempt, ex.error)
            got = self._recover(r, [c for c in d.present if c != self.me], numel,
                                wait=self.grace)
            if got is not None:
                return got
            if own.error:
                reason, own = f"cannot encode: {own.error}", None
            attempt += 1
            if attempt >= MAX_ATTEMPTS:
                self._event("round %d: giving up after %d attempts; zero update", r, attempt)
                return RoundOutcome(torch.zeros(numel), [], r, mode="failed")
            deadline = self.clock() + self.cfg.round_timeout

    def _agree(self, r: int, attempt: int, reason: str, numel: int, deadline: float,
               info: RoundInfo, codec: tuple[str, int]) -> Decision | str | None:
        """READY to the coordinator; wait for its decision (or BEHIND); None on time-out."""
        give_up = deadline + self.grace
        sent_to = None
        meta = {"op": "ready", "round": r, "attempt": attempt, "ok": not reason, "numel": numel,
                "reason": reason, "lineage": self.lineage_before(r), "info": info.to_meta(),
                "codec": codec[0], "codec_round": codec[1]}
        while True:
            with self.lock:
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
                    if now >= give_up or self.stopping:
                        return None
                    self.cv.wait(min(give_up - now, 0.5))
                    continue
            if coord == self.me:
                self._on_ready(self.me, meta)
            elif not self.net.send(coord, Frame(FrameType.ROUND, meta)):
                sent_to = None
                time.sleep(0.05)

    def _exchange(self, d: Decision, own: OwnChunks, numel: int, codec: Codec
                  ) -> RoundExchange:
        spans = chunk_spans(numel, self.cfg.chunk_numel, align=self.cfg.block_size)
        sched = Schedule(self.me, d.present, len(spans), all_to_all=codec.sparse)
        key = d.key
        ex_ref: list[RoundExchange] = []

        def send(dest: str, kind: str, k: int, enc: Encoded | None) -> None:
            meta = {"op": kind, "round": d.round, "attempt": d.attempt, "coord": d.coordinator,
                    "k": k}
            if enc is None:
                frame = Frame(FrameType.PEER_CHUNK, {**meta, "zero": True})
            else:
                frame = Frame(FrameType.PEER_CHUNK, {**meta, **enc.wire_meta()}, enc.payload)
            if not self.net.send(dest, frame, bulk=True) and ex_ref:
                ex_ref[0].fail(f"no link to {dest}")

        ex = RoundExchange(sched, spans, encode=codec.encode,
                           decode=lambda enc: decode(codec, enc), send=send,
                           weights=dict(d.weights), empty=self.empty, worker=True,
                           codec=codec.name)
        ex_ref.append(ex)
        with self.lock:
            self.exchanges[key] = ex
            self.phase[d.round] = "exchanging"
            early = self.early.pop(key)
        connected = set(self.net.connected())
        gone = [c for c in sched.others if c not in connected]
        if gone:
            ex.fail(f"present peer(s) {gone} not connected")
        for src, frame in early:
            self._feed(ex, src, frame)
        try:
            for k in range(len(spans)):
                if ex.error is not None:
                    break
                ex.add_own(k, own.get(k, self.stall_timeout))
            while not ex.wait(0.5):
                if ex.error is not None:
                    break
                if self.stopping:
                    ex.fail("relay stopping")
                elif self.clock() - ex.progress_at > self.stall_timeout:
                    ex.fail(f"no progress for {self.stall_timeout:g}s")
            if ex.done:  # our own chunks may still be on their way: the round ends when sent
                for c in sched.others:
                    self.net.flush(c, self.stall_timeout)
        except ExchangeError as exc:
            ex.fail(str(exc))
        ex_ref.clear()  # no cycle (ex -> send -> ex) keeps the average alive until a collection
        with self.lock:
            del self.exchanges[key]
            self.phase[d.round] = "done" if ex.done else "recovering"
            if ex.done:
                self.average = Average(d.round, list(d.present),
                                       sorted(set(d.rejected) | ex.dropped), ex.result,
                                       ex.codec)
            self.cv.notify_all()
        if not ex.done:
            for c in sched.others:
                self.net.send(c, Frame(FrameType.ROUND, {
                    "op": "abort", "round": d.round, "attempt": d.attempt,
                    "coord": d.coordinator, "reason": ex.error}))
        elif ex.dropped or ex.zeroed:
            self._event("round %d: dropped non-finite chunks from %s, %d average chunk(s) zeroed",
                        d.round, sorted(ex.dropped), ex.zeroed)
        return ex

    def _finish_round(self, r: int, out: RoundOutcome) -> None:
        self.record_lineage(out)
        with self.lock:
            self.done_round = max(self.done_round, out.round_id)
            self.outcomes = {k: v for k, v in self.outcomes.items() if k >= r - 1}
            self.outcomes[r] = out
            self.early.drop_through(r)
            self.phase = {k: v for k, v in self.phase.items() if k > r - 8}
            self.phase[r] = "done"
            self.behind_rounds = {b for b in self.behind_rounds if b > r}
            self.cv.notify_all()
        if out.missing:
            self._event("round %d: completed without %s (gone, or not ready by the deadline)", r,
                        ", ".join(out.missing))
        log.info("round %d done in %.2fs (%s%s): present %s%s%s%s%s", r, out.seconds, out.mode,
                 f", {out.codec}" if self.cfg.auto_codec else "",
                 out.present, f", weighted by samples {out.weights}" if len(
                     set(out.weights.values())) > 1 else "",
                 "" if out.next_h is None else f", next H {out.next_h}",
                 f", next codec {out.next_codec}" if out.next_codec and out.next_codec !=
                 out.codec else "",
                 "" if out.next_merge is None else
                 f", next average applied {out.next_merge} steps after its boundary")
        self._finished(r, out)

    # ------------------------------------------------------------------ for peers and workers

    def newest_done(self) -> int:
        with self.lock:
            own = self.done_round
        return max(own, self.net.peers_done())

    def best_state(self) -> GlobalState | None:
        """The newest global state held here or by a connected peer."""
        with self.lock:
            best = self.state
        for cluster, state_round in self.net.state_sources():
            if state_round is None or (best is not None and best.round_id >= state_round):
                break
            st = self.net.fetch(cluster, {"op": "state", "min_round": state_round, "wait": 0},
                                self.fetch_timeout)
            if isinstance(st, GlobalState):
                best = st
        return best
