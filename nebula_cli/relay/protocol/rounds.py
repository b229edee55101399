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
   peer's published global state instead. If a present peer disappears mid-exchange, the
   survivors fetch the result from one that completed, else redo the round (at most
   MAX_ATTEMPTS, then a zero delta). With no peer reachable at all a cluster averages alone.

:class:`Rounds` owns its parts as objects, each handed the shared
:class:`~nebula_cli.relay.protocol.round_state.RoundState` and the :class:`Net`: ``control``
(:class:`~nebula_cli.relay.protocol.round_control.RoundControl`: round control and chunks from
peers, the coordinator, agreeing a round; anything for a round too far ahead, a decision a peer
did not make, or an early chunk beyond what the sync size allows is refused there) and
``recovery`` (:class:`~nebula_cli.relay.protocol.recovery.Recovery`: fetching, catching up,
resyncing, averaging alone, the final state). A round's exchange runs on a fresh
:class:`~nebula_cli.relay.protocol.allreduce.RoundExchange` per decision. Messages from peers
reach ``control`` already decoded (:mod:`nebula_cli.relay.protocol.messages`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import Codec, Encoded
from nebula_cli.relay.codecs.chunks import chunk_spans
from nebula_cli.relay.codecs.contribution import OwnChunks, check_contribution, decode
from nebula_cli.relay.codecs.feedback import ErrorFeedback
from nebula_cli.relay.net.limits import Refusals, SyncSize
from nebula_cli.relay.net.messages import RelayProgress
from nebula_cli.relay.protocol.agreement import BEHIND, Decision
from nebula_cli.relay.protocol.allreduce import ExchangeError, RoundExchange, Schedule
from nebula_cli.relay.protocol.messages import (
    MAX_ATTEMPTS,
    Abort,
    ChunkKind,
    PeerChunk,
    RoundMessage,
    round_frame,
)
from nebula_cli.relay.protocol.network import Net
from nebula_cli.relay.protocol.pacing import RoundInfo
from nebula_cli.relay.protocol.recovery import Recovery
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundMode, RoundOutcome
from nebula_cli.relay.protocol.round_control import RoundControl
from nebula_cli.relay.protocol.round_state import Phase, RoundState, Step, after_decision

log = logging.getLogger("nebula.relay")

STARTUP_GRACE = 6.0
"""After a (re)start, a round waits up to this long (from the start) for peers that have not
been connected yet, so that a restarted relay learns how far its peers are first."""

__all__ = ["STARTUP_GRACE", "Rounds"]


class Rounds:
    """One relay's rounds. ``event(msg, *args)`` reports a warning-worthy event;
    ``finished(request_round, outcome)`` runs after each round; ``empty(numel)`` makes a
    round's average (None: torch.empty)."""

    def __init__(self, cfg: RelayConfig, codecs: Mapping[str, Codec], net: Net, *,
                 event: Callable[..., None], finished: Callable[[int, RoundOutcome], None],
                 refusals: Refusals, clock: Callable[[], float] = time.monotonic,
                 empty: Callable[[int], torch.Tensor] | None = None) -> None:
        self.cfg, self.me, self.net = cfg, cfg.cluster, net
        self.clock = clock
        self.state = RoundState()
        self.control = RoundControl(cfg, codecs, self.state, net, refusals=refusals,
                                    clock=clock)
        self.recovery = Recovery(cfg, self.state, net, event=event, clock=clock)
        self.round_lock = threading.Lock()  # one local round at a time
        self.prev_exchanged = False  # this relay's previous round was an exchange with peers
        self.prev_codec: str | None = None  # the codec of this relay's previous round
        self.empty = empty
        self.feedback = (ErrorFeedback(self.control.codec, cfg.feedback_decay)
                         if cfg.error_feedback else None)
        self.grace = max(2.0, 2 * cfg.heartbeat)
        self.stall_timeout = max(30.0, 3 * cfg.round_timeout)
        self._event, self._finished = event, finished
        self.started = clock()

    def stop(self) -> None:
        """End every wait and exchange (the relay is stopping)."""
        self.state.stop()

    # ------------------------------------------------------------------ what the relay asks
    # (the process layer: relay.process.server and worker_port call these, never the parts)

    @property
    def sync(self) -> SyncSize | None:
        """What this cluster syncs (None until its worker registered)."""
        return self.state.sync

    @property
    def done_round(self) -> int:
        """The newest round this relay completed (-1: none)."""
        return self.state.done_round

    def finished_at(self) -> int | None:
        """The round this cluster's workers finished at (None while they train)."""
        with self.state.lock:
            return self.state.finished

    def progress(self) -> RelayProgress:
        """This relay's progress as its peers see it (HELLO, heartbeats)."""
        return self.state.progress()

    def register(self, size: SyncSize) -> None:
        """The worker's sync size (the first registration fixes it; LimitExceeded after)."""
        self.state.register(size)

    def publish(self, st: GlobalState) -> None:
        """A global state the worker published, served to peers that catch up."""
        self.state.publish(st)

    def mark_finished(self) -> None:
        """This cluster's workers are done training."""
        self.state.mark_finished()

    def answer_result(self, round_id: int, wait: float, gone: Callable[[], bool]
                      ) -> Average | None:
        """A peer's fetch of round ``round_id``'s average: it, once held here, or None."""
        return self.state.answer_result(round_id, wait, gone)

    def answer_state(self, min_round: int, wait: float) -> GlobalState | None:
        """A peer's fetch of a global state of at least ``min_round``, or None."""
        return self.state.answer_state(min_round, wait)

    def best_state(self) -> GlobalState | None:
        """The newest global state held here or by a connected peer."""
        return self.recovery.best_state()

    def final_state(self, wait: float | None) -> GlobalState | None:
        """The state this cluster ends with, once every connected cluster is done."""
        return self.recovery.final_state(wait)

    def on_control(self, src: str, msg: RoundMessage) -> None:
        """A peer's round control (READY, START, BEHIND, ABORT)."""
        self.control.on_control(src, msg)

    def on_chunk(self, src: str, chunk: PeerChunk) -> None:
        """A peer's chunk of a round's exchange."""
        self.control.on_chunk(src, chunk)

    def on_progress(self) -> None:
        """A peer's progress changed (its heartbeat)."""
        self.control.on_progress()

    def on_link_up(self) -> None:
        self.control.on_link_up()

    def on_link_down(self, cluster: str, reason: str) -> None:
        self.control.on_link_down(cluster, reason)

    def tick(self) -> float | None:
        """The coordinator's deadlines; when the next one is due (None: none)."""
        return self.control.tick()

    # ------------------------------------------------------------------ the worker's round

    def local_round(self, round_id: int, x: torch.Tensor,
                    info: RoundInfo | None = None) -> RoundOutcome:
        """Run (or, for a retried request, return again) round ``round_id`` for this cluster;
        ``info``: what the worker said of its round (relay.cadence). The first contribution
        registers the sync size if the worker did not."""
        state = self.state
        if state.sync is None:
            state.register(SyncSize.flat(x.numel()))
        self.control.raise_floor(round_id)
        with state.lock:
            state.finished = None  # a worker that said goodbye came back (restarted)
        with self.round_lock:
            cached = state.outcomes.get(round_id)
            if cached is not None:
                return cached
            t0 = self.clock()
            sent0, recv0 = self.net.wan_bytes()
            codec, known = self.control.in_force()
            info = info or RoundInfo()  # an arrival after a fetch or alone is not a round's
            info = dataclasses.replace(info, codec=self.prev_codec,
                                       arrive_s=info.arrive_s if self.prev_exchanged else None)
            out = self._run_round(round_id, x, info, codec, known)
            out.codec = out.codec or codec.name  # averages carry theirs; the rest apply none
            with state.lock:
                if out.next.merge is None and self.control.merge_in_force is not None:
                    out.next = dataclasses.replace(out.next, merge=self.control.merge_in_force)
            self.prev_codec = out.codec
            self.prev_exchanged = (out.mode in (RoundMode.DIRECT, RoundMode.SHARD)
                                   and out.global_state is None)
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
        state, recovery = self.state, self.recovery
        with state.lock:
            state.cv.wait_for(lambda: self.net.all_linked_once()
                              or self.clock() > self.started + STARTUP_GRACE
                              or state.stopping, max(0.0, self.started + STARTUP_GRACE
                                                     - self.clock()))
        deadline = self.clock() + self.cfg.round_timeout
        if r <= state.newest_done(self.net):
            return recovery.catch_up(r, numel, "a peer has already completed this round")
        own = None if reason else OwnChunks(x, self.cfg.chunk_numel, self.cfg.block_size,
                                            codec, self.feedback)
        state.set_phase(r, Phase.AGREEING)
        attempt = 0
        while True:
            d = self.control.agree(r, attempt, reason, numel, deadline + self.grace, info,
                                   (codec.name, known))
            if d == BEHIND:
                return recovery.catch_up(r, numel, "the coordinator says this round is over")
            if not isinstance(d, Decision):
                self._event("round %d: no decision from coordinator %s by the deadline", r,
                            self.net.coordinator())
                got = recovery.recover(r, self.net.connected(), numel)
                if got is not None:
                    return got
                return recovery.alone(r, x if own else None, numel, codec)
            step = after_decision(self.me, d, own_ok=own is not None)
            if step == Step.RESYNC:
                return recovery.resync(r, list(d.present), numel)
            if step != Step.EXCHANGE:
                why = "late" if self.me in d.missing else "rejected"
                if step == Step.EMPTY:
                    self._event("round %d: this cluster was left out (%s) and nobody is "
                                "present; zero update", r, why)
                    return RoundOutcome(torch.zeros(numel), [], r, list(d.rejected),
                                   list(d.missing), mode=RoundMode.EMPTY)
                self._event("round %d: this cluster was left out (%s); fetching the average", r,
                            why)
                got = recovery.recover(r, list(d.present), numel)
                if got is not None:
                    return got
                return recovery.catch_up(r, numel, "no present peer could hand over the average")
            assert own is not None
            ex = self._exchange(d, own, numel, codec)
            if ex.done:
                return RoundOutcome(ex.result, list(d.present), r, sorted(set(d.rejected) |
                               ex.dropped), list(d.missing), mode=ex.schedule.mode,
                               weights=dict(d.weights), codec=codec.name, next=d.next)
            self._event("round %d attempt %d failed: %s", r, attempt, ex.error)
            got = recovery.recover(r, [c for c in d.present if c != self.me], numel,
                                   wait=self.grace)
            if got is not None:
                return got
            if own.error:
                reason, own = f"cannot encode: {own.error}", None
            attempt += 1
            if attempt >= MAX_ATTEMPTS:
                self._event("round %d: giving up after %d attempts; zero update", r, attempt)
                return RoundOutcome(torch.zeros(numel), [], r, mode=RoundMode.FAILED)
            deadline = self.clock() + self.cfg.round_timeout

    def _exchange(self, d: Decision, own: OwnChunks, numel: int, codec: Codec
                  ) -> RoundExchange:
        spans = chunk_spans(numel, self.cfg.chunk_numel, align=self.cfg.block_size)
        sched = Schedule(self.me, d.present, len(spans), all_to_all=codec.sparse)
        key = d.key
        ex_ref: list[RoundExchange] = []

        def send(dest: str, kind: str, k: int, enc: Encoded | None) -> None:
            frame = PeerChunk(kind=ChunkKind(kind), round=d.round, attempt=d.attempt,
                              coord=d.coordinator, k=k,
                              enc=enc).to_frame()
            if not self.net.send(dest, frame, bulk=True) and ex_ref:
                ex_ref[0].fail(f"no link to {dest}")

        ex = RoundExchange(sched, spans, encode=codec.encode,
                           decode=lambda enc: decode(codec, enc), send=send,
                           weights=dict(d.weights), empty=self.empty, worker=True,
                           codec=codec.name)
        ex_ref.append(ex)
        state = self.state
        with state.lock:
            state.exchanges[key] = ex
            state.phase[d.round] = Phase.EXCHANGING
            early = self.control.early.pop(key)
        connected = set(self.net.connected())
        gone = [c for c in sched.others if c not in connected]
        if gone:
            ex.fail(f"present peer(s) {gone} not connected")
        for src, chunk in early:
            self.control.feed(ex, src, chunk)
        try:
            for k in range(len(spans)):
                if ex.error is not None:
                    break
                ex.add_own(k, own.get(k, self.stall_timeout))
            while not ex.wait(0.5):
                if ex.error is not None:
                    break
                if state.stopping:
                    ex.fail("relay stopping")
                elif self.clock() - ex.progress_at > self.stall_timeout:
                    ex.fail(f"no progress for {self.stall_timeout:g}s")
            if ex.done:  # our own chunks may still be on their way: the round ends when sent
                for c in sched.others:
                    self.net.flush(c, self.stall_timeout)
        except ExchangeError as exc:
            ex.fail(str(exc))
        ex_ref.clear()  # no cycle (ex -> send -> ex) keeps the average alive until a collection
        with state.lock:
            del state.exchanges[key]
            state.phase[d.round] = Phase.DONE if ex.done else Phase.RECOVERING
            if ex.done:
                state.average = Average(d.round, list(d.present),
                                        sorted(set(d.rejected) | ex.dropped), ex.result,
                                        ex.codec)
            state.cv.notify_all()
        if not ex.done:
            abort = round_frame(Abort(round=d.round, attempt=d.attempt, coord=d.coordinator,
                                      reason=ex.error or ""))
            for c in sched.others:
                self.net.send(c, abort)
        elif ex.dropped or ex.zeroed:
            self._event("round %d: dropped non-finite chunks from %s, %d average chunk(s) zeroed",
                        d.round, sorted(ex.dropped), ex.zeroed)
        return ex

    def _finish_round(self, r: int, out: RoundOutcome) -> None:
        state = self.state
        state.record_lineage(out)
        with state.lock:
            state.done_round = max(state.done_round, out.round_id)
            state.outcomes = {r: out}  # the worker's next request is for a later round
            state.phase = {k: v for k, v in state.phase.items() if k > r - 8}
            state.phase[r] = Phase.DONE
            self.control.round_done(r)
            state.cv.notify_all()
        if out.missing:
            self._event("round %d: completed without %s (gone, or not ready by the deadline)", r,
                        ", ".join(out.missing))
        nxt = out.next
        log.info("round %d done in %.2fs (%s%s): present %s%s%s%s%s", r, out.seconds, out.mode,
                 f", {out.codec}" if self.cfg.auto_codec else "",
                 out.present, f", weighted by samples {out.weights}" if len(
                     set(out.weights.values())) > 1 else "",
                 "" if nxt.h is None else f", next H {nxt.h}",
                 f", next codec {nxt.codec}" if nxt.codec and nxt.codec !=
                 out.codec else "",
                 "" if nxt.merge is None else
                 f", next average applied {nxt.merge} steps after its boundary")
        self._finished(r, out)

