"""What a relay holds between rounds, and the pure decisions the round driver takes on it.

:class:`RoundState` is the data that the round driver
(:class:`nebula_cli.relay.protocol.rounds.Rounds`) and the collaborators it owns (peer control,
recovery) share, under one lock and one condition: the size this cluster syncs, the newest
round done, the last average and the published global state (what peers may fetch), the
exchanges in flight, the lineage. Its answers to peers' requests wait on that condition and
never touch the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum

from nebula_cli.relay.net.limits import LimitExceeded, SyncSize
from nebula_cli.relay.net.messages import RelayProgress
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.allreduce import RoundExchange
from nebula_cli.relay.protocol.lineage import UNKNOWN, advance, initial
from nebula_cli.relay.protocol.network import Net
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundOutcome

log = logging.getLogger("nebula.relay")

LINEAGES_KEPT = 16


class Phase(StrEnum):
    """Where a round is on this relay (peers asking for its average wait while it is agreed or
    exchanged)."""

    AGREEING = "agreeing"
    EXCHANGING = "exchanging"
    RECOVERING = "recovering"
    DONE = "done"


class Step(StrEnum):
    """What a relay does once its round is decided (:func:`after_decision`)."""

    EXCHANGE = "exchange"
    """It is present and can send: exchange with the other present relays."""
    RESYNC = "resync"
    """Its global state diverged: take a present peer's."""
    LEFT_OUT = "left-out"
    """Fetch the average of those present."""
    EMPTY = "empty"
    """Nobody is present: zeros."""


def after_decision(me: str, d: Decision, *, own_ok: bool) -> Step:
    """What relay ``me`` does once its round is decided (``own_ok``: its contribution can be
    sent)."""
    if me in d.diverged and d.present:
        return Step.RESYNC
    if me in d.present and own_ok:
        return Step.EXCHANGE
    return Step.LEFT_OUT if d.present else Step.EMPTY


class RoundState:
    """The rounds' shared data and the answers served from it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.sync: SyncSize | None = None
        self.exchanges: dict[tuple[int, int, str], RoundExchange] = {}
        """Exchanges in flight by (round, attempt, coordinator)."""
        self.phase: dict[int, Phase] = {}
        self.outcomes: dict[int, RoundOutcome] = {}
        """The last round's outcome (a retried request gets the same one; its worker asks for
        one round at a time, so no older outcome is held: one round's average less in memory)."""
        self.done_round = -1
        self.average: Average | None = None
        """The newest average this relay holds (served to peers that missed it)."""
        self.published: GlobalState | None = None
        """The newest global state this cluster's workers published (served to peers that
        catch up or resync)."""
        self.lineage: str | None = None  # set by the first round (see relay.lineage)
        self.lineages: dict[int, str] = {}  # round -> lineage after it
        self.finished: int | None = None  # this cluster's last round, once its workers ended
        self.stopping = False

    def register(self, size: SyncSize) -> None:
        """Fix what this cluster syncs (first registration wins); LimitExceeded if a later
        one differs."""
        with self.lock:
            if self.sync is None:
                self.sync = size
                log.info("this cluster syncs %d tensor(s), %d elements", size.tensors,
                         size.numel)
            elif size.numel != self.sync.numel:
                raise LimitExceeded(f"{size.numel} elements, but this relay syncs "
                                    f"{self.sync.numel} (its workers' first registration)")

    def newest_done(self, net: Net) -> int:
        """The newest round this relay or a connected peer has completed."""
        with self.lock:
            own = self.done_round
        return max(own, net.peers_done())

    def set_phase(self, round_id: int, phase: Phase) -> None:
        with self.lock:
            self.phase[round_id] = phase
            self.cv.notify_all()

    def poke(self) -> None:
        """Wake every wait (something on the network changed)."""
        with self.lock:
            self.cv.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for ex in self.exchanges.values():
                ex.fail("relay stopping")
            self.cv.notify_all()

    def mark_finished(self) -> None:
        """This cluster's workers have made their last round (told to peers with the next
        progress)."""
        with self.lock:
            self.finished = self.done_round
            self.cv.notify_all()

    def progress(self) -> RelayProgress:
        """This relay's progress as peers see it (HELLO, heartbeats)."""
        with self.lock:
            return RelayProgress(done=self.done_round,
                            state_round=self.published.round_id if self.published else None,
                            result_round=self.average.round_id if self.average else None,
                            finished=self.finished, lineage=self.lineage, sync=self.sync)

    def lineage_before(self, round_id: int) -> str:
        """This relay's lineage as its round ``round_id`` starts."""
        with self.lock:
            if self.lineage is None:
                self.lineage = initial(round_id)
            return self.lineage

    def record_lineage(self, out: RoundOutcome) -> str:
        """Advance the lineage by what round ``out.round_id`` applied (nothing: unchanged)."""
        with self.lock:
            prev = self.lineage or initial(out.round_id)
            if out.global_state is not None:
                new = out.lineage or UNKNOWN
            elif out.present:
                new = advance(prev, out.round_id, out.present, out.tensor, out.codec)
            else:
                new = prev
            self.lineage = new
            self.lineages[out.round_id] = new
            for k in sorted(self.lineages)[:-LINEAGES_KEPT]:
                del self.lineages[k]
            return new

    def publish(self, st: GlobalState) -> None:
        """A worker's theta_global after a round (kept if it is the newest), tagged with this
        relay's lineage after that round."""
        with self.lock:
            lineage = self.lineages.get(st.round_id, st.lineage or UNKNOWN)
            if self.published is None or st.round_id >= self.published.round_id:
                self.published = GlobalState(st.round_id, st.tensor, lineage, st.parts)
            self.cv.notify_all()

    def answer_result(self, round_id: int, wait: float, gone: Callable[[], bool]
                      ) -> Average | None:
        """Round ``round_id``'s average, waiting (up to ``wait``) while that round is still
        being agreed or exchanged here."""
        deadline = time.monotonic() + wait
        with self.lock:
            self.cv.wait_for(
                lambda: self.phase.get(round_id) not in (Phase.AGREEING, Phase.EXCHANGING)
                or (self.average is not None and self.average.round_id == round_id)
                or time.monotonic() > deadline or gone() or self.stopping, wait)
            avg = self.average
        return avg if avg is not None and avg.round_id == round_id else None

    def answer_state(self, min_round: int, wait: float) -> GlobalState | None:
        """The global state held here, waiting up to ``wait`` for one of ``min_round``."""
        with self.lock:
            self.cv.wait_for(lambda: (self.published is not None
                                      and self.published.round_id >= min_round)
                             or self.stopping, wait)
            return self.published
