"""What a relay holds between rounds, and the pure decisions the round driver takes on it.

:class:`RoundState` is the data of :class:`nebula_cli.relay.protocol.rounds.Rounds` (one lock, one
condition): the newest round done, the last average and the published global state (what
peers may fetch), decisions and exchanges in flight. Its answers to peers' requests wait on
that condition and never touch the network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from nebula_cli.relay.net.limits import LimitExceeded, SyncSize
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.allreduce import RoundExchange
from nebula_cli.relay.protocol.lineage import UNKNOWN, advance, initial
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundOutcome

log = logging.getLogger("nebula.relay")

EXCHANGE, LEFT_OUT, EMPTY, RESYNC = "exchange", "left-out", "empty", "resync"
LINEAGES_KEPT = 16


def after_decision(me: str, d: Decision, *, own_ok: bool) -> str:
    """What a relay does once its round is decided: EXCHANGE (it is present and can send),
    RESYNC (its global state diverged: take a present peer's), LEFT_OUT (fetch the average of
    those present), or EMPTY (nobody present: zeros)."""
    if me in d.diverged and d.present:
        return RESYNC
    if me in d.present and own_ok:
        return EXCHANGE
    return LEFT_OUT if d.present else EMPTY


class RoundState:
    """The rounds' shared data and the answers served from it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self.round_lock = threading.Lock()  # one local round at a time
        self.sync: SyncSize | None = None
        self.decisions: dict[tuple[int, str], Decision] = {}  # (round, coordinator) ->
        self.behind_rounds: set[int] = set()
        self.exchanges: dict[tuple[int, int, str], RoundExchange] = {}
        self.phase: dict[int, str] = {}  # round -> agreeing | exchanging | recovering | done
        self.outcomes: dict[int, RoundOutcome] = {}
        self.done_round = -1
        self.average: Average | None = None
        self.state: GlobalState | None = None
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

    def set_phase(self, round_id: int, phase: str) -> None:
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

    def progress_meta(self) -> dict[str, Any]:
        """This relay's progress as peers see it (HELLO, heartbeats)."""
        with self.lock:
            return {"done": self.done_round,
                    "state_round": self.state.round_id if self.state else None,
                    "result_round": self.average.round_id if self.average else None,
                    "sync": self.sync.to_meta() if self.sync else None,
                    "finished": self.finished, "lineage": self.lineage}

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
            if self.state is None or st.round_id >= self.state.round_id:
                self.state = GlobalState(st.round_id, st.tensor, lineage, st.parts)
            self.cv.notify_all()

    def answer_result(self, round_id: int, wait: float, gone: Callable[[], bool]
                      ) -> Average | None:
        """Round ``round_id``'s average, waiting (up to ``wait``) while that round is still
        being agreed or exchanged here."""
        deadline = time.monotonic() + wait
        with self.lock:
            self.cv.wait_for(
                lambda: self.phase.get(round_id) not in ("agreeing", "exchanging")
                or (self.average is not None and self.average.round_id == round_id)
                or time.monotonic() > deadline or gone() or self.stopping, wait)
            avg = self.average
        return avg if avg is not None and avg.round_id == round_id else None

    def answer_state(self, min_round: int, wait: float) -> GlobalState | None:
        """The global state held here, waiting up to ``wait`` for one of ``min_round``."""
        with self.lock:
            self.cv.wait_for(lambda: (self.state is not None and self.state.round_id >= min_round)
                             or self.stopping, wait)
            return self.state
