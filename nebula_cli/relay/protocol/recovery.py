"""How a relay gets a round's result when it could not compute it with its peers: fetch the
average from a peer that completed the round, catch up from a peer's published global state
when it is behind or its state diverged (see :mod:`nebula_cli.relay.protocol.lineage`), or
average alone when nobody can be reached; and, at the end, the state every cluster ends with.

:class:`Recovery` is one collaborator of the round driver
(:class:`nebula_cli.relay.protocol.rounds.Rounds` owns one): it is handed the rounds' shared
:class:`~nebula_cli.relay.protocol.round_state.RoundState` and the
:class:`~nebula_cli.relay.protocol.network.Net`, and talks to peers only through the latter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.base import Codec
from nebula_cli.relay.codecs.contribution import decode
from nebula_cli.relay.protocol.messages import ResultAsk, StateAsk
from nebula_cli.relay.protocol.network import Net
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundMode, RoundOutcome
from nebula_cli.relay.protocol.round_state import Phase, RoundState

log = logging.getLogger("nebula.relay")


class Recovery:
    """The recovery paths of one relay's rounds. ``event(msg, *args)`` reports a
    warning-worthy event; ``clock`` is the rounds' monotonic clock."""

    def __init__(self, cfg: RelayConfig, state: RoundState, net: Net, *,
                 event: Callable[..., None], clock: Callable[[], float]) -> None:
        self.cfg, self.me, self.state, self.net = cfg, cfg.cluster, state, net
        self._event, self.clock = event, clock
        self.order = {c: i for i, c in enumerate(cfg.clusters)}
        self.fetch_timeout = max(120.0, 10 * cfg.round_timeout)
        self.final_stall = max(600.0, 10 * cfg.round_timeout)
        """At the end, how long a cluster waits for peers that make no round at all."""

    def recover(self, r: int, candidates: list[str], numel: int,
                wait: float | None = None) -> RoundOutcome | None:
        """Fetch round ``r``'s average from a peer that completed it. ``wait``: how long a
        peer still agreeing or exchanging that round may take to answer (default: as long as
        the peer allows; short after a failed exchange, when a peer that never saw the
        decision would otherwise hold this relay until its deadline)."""
        self.state.set_phase(r, Phase.RECOVERING)
        ask = ResultAsk(round=r, wait=wait)
        for c in sorted(candidates, key=self.order.__getitem__):
            if c == self.me:
                continue
            got = self.net.fetch(c, ask, self.fetch_timeout)
            if not isinstance(got, Average) or got.tensor.numel() != numel:
                continue
            missing = sorted(set(self.cfg.clusters) - set(got.present) - set(got.rejected))
            with self.state.lock:
                self.state.average = Average(r, got.present, got.rejected, got.tensor, got.codec)
            return RoundOutcome(got.tensor, got.present, r, got.rejected, missing,
                                mode=RoundMode.FETCHED, codec=got.codec)
        return None

    def catch_up(self, r: int, numel: int, why: str) -> RoundOutcome:
        """This cluster is behind: a peer's round-r average if one has it, else a global state."""
        self._event("round %d: this cluster is behind (%s); catching up", r, why)
        with self.state.lock:
            avg = self.state.average
        if avg is not None and avg.round_id == r:
            return RoundOutcome(avg.tensor, avg.present, r, avg.rejected, mode=RoundMode.CACHED,
                                codec=avg.codec)
        got = self.recover(r, self.net.holders(r), numel)
        if got is not None:
            return got
        newest = self.state.newest_done(self.net)
        with self.state.lock:
            best = self.state.published
        for cluster, _ in self.net.state_sources():
            if best is not None and best.round_id >= newest:
                break
            st = self.fetch_state(cluster, newest)
            if st is not None and (best is None or st.round_id > best.round_id):
                best = st
        if best is None:
            self._event("round %d: no global state available to catch up from; zero update", r)
            return RoundOutcome(torch.zeros(numel), [], r, mode=RoundMode.FAILED)
        log.info("round %d: caught up to round %d from a published global state", r,
                 best.round_id)
        return self._taken(best, numel, RoundMode.CATCH_UP)

    def resync(self, r: int, present: list[str], numel: int) -> RoundOutcome:
        """This cluster's global state diverged from the round's winning lineage: take the
        state a present peer publishes after round ``r``."""
        self._event("round %d: this cluster's global state differs from that of %s; taking "
                    "theirs", r, ", ".join(present))
        self.state.set_phase(r, Phase.RECOVERING)
        for c in sorted(present, key=self.order.__getitem__):
            st = self.fetch_state(c, r)
            if st is not None and st.round_id >= r:
                return self._taken(st, numel, RoundMode.RESYNC)
        self._event("round %d: no present peer handed over its global state; zero update", r)
        return RoundOutcome(torch.zeros(numel), [], r, mode=RoundMode.FAILED)

    def alone(self, r: int, x: torch.Tensor | None, numel: int, codec: Codec) -> RoundOutcome:
        """No peer could be reached: this cluster's own contribution (as decoded from its
        encoding, as a round with peers would use it), or zeros when it has none."""
        others = [c for c in self.cfg.clusters if c != self.me]
        if x is None:
            return RoundOutcome(torch.zeros(numel), [], r, [self.me], others,
                                mode=RoundMode.ALONE)
        avg = decode(codec, codec.encode(x))
        with self.state.lock:
            self.state.average = Average(r, [self.me], [], avg, codec.name)
        return RoundOutcome(avg, [self.me], r, [], others, mode=RoundMode.ALONE,
                            codec=codec.name)

    def fetch_state(self, cluster: str, min_round: int) -> GlobalState | None:
        """A peer's published global state of at least ``min_round`` (waiting up to a round's
        timeout for it), or None."""
        st = self.net.fetch(cluster, StateAsk(min_round=min_round,
                                              wait=self.cfg.round_timeout), self.fetch_timeout)
        return st if isinstance(st, GlobalState) else None

    def best_state(self) -> GlobalState | None:
        """The newest global state held here or by a connected peer."""
        with self.state.lock:
            best = self.state.published
        for cluster, state_round in self.net.state_sources():
            if state_round is None or (best is not None and best.round_id >= state_round):
                break
            st = self.net.fetch(cluster, StateAsk(min_round=state_round, wait=0.0),
                                self.fetch_timeout)
            if isinstance(st, GlobalState):
                best = st
        return best

    def final_state(self, wait: float | None) -> GlobalState | None:
        """After ``RoundState.mark_finished``: wait until every other cluster's workers have
        finished too (at most ``wait`` seconds), then the global state every cluster should end
        with, when it is not this cluster's: that of the cluster that finished last (the
        highest final round, ties to the earliest in the job's order), whose last round came
        after the others'. None: keep your own.

        A peer that is not connected is waited for as one that still trains: a link cut or a
        host gone down near the end comes back, its cluster finishes, and whichever finished
        last hands its state over (ending without it left two parameter sets). Not waited
        for: a peer whose relay said, as it went, that its cluster left the job
        (``Net.departed``), and one seen to finish. The wait ends when no peer it waits for
        has made a round (or finished) for ``final_stall`` seconds, a link that only comes and
        goes being no round; and after ``wait``."""
        state = self.state
        deadline = None if wait is None else self.clock() + wait
        rounds: dict[str, tuple[int | None, int]] = {}  # peer -> (finished, done) last seen
        ends: dict[str, tuple[int, str | None]] = {}  # peer -> (final round, lineage) seen
        moved, told = self.clock(), []
        while True:
            view = self.net.finish_view()  # not under the lock: the peers' lock comes first
            left = self.net.departed()
            for c, (f, lin, done) in view.items():
                if rounds.get(c, (f, done)) != (f, done):
                    moved = self.clock()  # a round, a finish: news of it
                rounds[c] = (f, done)
                if f is None:
                    ends.pop(c, None)  # training again (resumed)
                else:
                    ends[c] = (f, lin)
            absent = [c for c in self.cfg.clusters
                      if c != self.me and c not in view and c not in left and c not in ends]
            waiting = sorted([c for c, (f, _, _) in view.items() if f is None] + absent,
                             key=self.order.__getitem__)
            if not waiting or state.stopping:
                break
            if absent and absent != told:
                told = absent
                self._event("peers %s are not connected as this cluster finishes; waiting for "
                            "them to come back and finish (until none has made a round for "
                            "%g s)", ", ".join(absent), self.final_stall)
            if deadline is not None and self.clock() >= deadline:
                self._event("peers %s have not finished after %g s; this cluster ends without "
                            "their last rounds", ", ".join(waiting), wait)
                break
            if self.clock() - moved > self.final_stall:
                self._event("peers %s made no round in %g s; this cluster ends without "
                            "them", ", ".join(waiting), self.final_stall)
                break
            with state.lock:
                state.cv.wait(0.5)
        with state.lock:
            mine = state.finished if state.finished is not None else state.done_round
            lineage = state.lineage
        last, cluster, theirs = max([(mine, self.me, lineage)]
                                    + [(f, c, lin) for c, (f, lin) in ends.items()],
                                    key=lambda e: (e[0], -self.order[e[1]]))
        if cluster == self.me or theirs == lineage:
            return None
        st = self.fetch_state(cluster, last)
        if st is None or st.round_id < last:
            self._event("could not fetch the final state of %s (round %d); this cluster keeps "
                        "its own", cluster, last)
            return None
        log.info("final state: taking that of %s after round %d (it finished last)", cluster,
                 last)
        with state.lock:
            state.lineage = st.lineage
        return st

    @staticmethod
    def _taken(st: GlobalState, numel: int, mode: RoundMode) -> RoundOutcome:
        return RoundOutcome(torch.zeros(numel), [], st.round_id, global_state=st.tensor,
                            mode=mode, lineage=st.lineage)
