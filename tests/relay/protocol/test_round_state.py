"""relay/protocol/round_state.py: what a relay holds between rounds, and the answers it serves
to peers from it (no network: they wait on its condition)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nebula_cli.relay.net.limits import LimitExceeded, SyncSize
from nebula_cli.relay.protocol.agreement import Decision
from nebula_cli.relay.protocol.lineage import GENESIS, UNKNOWN, advance
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundMode, RoundOutcome
from nebula_cli.relay.protocol.round_state import (
    LINEAGES_KEPT,
    Phase,
    RoundState,
    Step,
    after_decision,
)


class PeersAt:
    """The one thing RoundState asks of the network: the newest round a peer completed."""

    def __init__(self, done: int) -> None:
        self.done = done

    def peers_done(self) -> int:
        return self.done


def test_after_a_decision_a_diverged_relay_resyncs_before_anything_else() -> None:
    d = Decision(round=3, attempt=0, coordinator="a", present=("a",), rejected=(), missing=(),
                 numel=10, diverged=("b",))
    assert after_decision("b", d, own_ok=True) == Step.RESYNC
    assert after_decision("a", d, own_ok=True) == Step.EXCHANGE
    alone = Decision(round=3, attempt=0, coordinator="a", present=(), rejected=(), missing=(),
                     numel=10, diverged=("b",))
    assert after_decision("b", alone, own_ok=True) == Step.EMPTY  # nobody to take it from


def test_the_first_registration_fixes_the_sync_size() -> None:
    state = RoundState()
    state.register(SyncSize(((2, 3),), ("float32",)))
    state.register(SyncSize.flat(6))  # the same size (a worker that reconnected)
    with pytest.raises(LimitExceeded, match="this relay syncs 6"):
        state.register(SyncSize.flat(7))
    assert state.progress().sync == SyncSize(((2, 3),), ("float32",))


def test_newest_done_is_this_relays_or_a_peers() -> None:
    state = RoundState()
    state.done_round = 4
    assert state.newest_done(PeersAt(2)) == 4 and state.newest_done(PeersAt(9)) == 9


def test_the_lineage_advances_by_what_a_round_applied() -> None:
    state = RoundState()
    assert state.lineage_before(0) == GENESIS
    avg = torch.ones(4)
    joint = RoundOutcome(avg, ["a", "b"], 0, mode=RoundMode.DIRECT, codec="int8")
    after = state.record_lineage(joint)
    assert after == advance(GENESIS, 0, ["a", "b"], avg, "int8") == state.lineages[0]
    nothing = RoundOutcome(torch.zeros(4), [], 1, mode=RoundMode.FAILED)
    assert state.record_lineage(nothing) == after  # a zero update leaves it as it was
    taken = RoundOutcome(torch.zeros(4), [], 2, global_state=avg, mode=RoundMode.CATCH_UP,
                         lineage="theirs")
    assert state.record_lineage(taken) == "theirs"
    restarted = RoundState()
    assert restarted.lineage_before(7) == UNKNOWN  # a relay started mid-job knows nothing
    for r in range(3, 3 + 2 * LINEAGES_KEPT):
        state.record_lineage(RoundOutcome(avg, ["a"], r, mode=RoundMode.ALONE))
    assert len(state.lineages) == LINEAGES_KEPT


def test_a_published_state_is_kept_if_newest_and_tagged_with_its_rounds_lineage() -> None:
    state = RoundState()
    state.record_lineage(RoundOutcome(torch.ones(2), ["a"], 0, mode=RoundMode.ALONE))
    state.publish(GlobalState(0, torch.ones(2)))
    assert state.published is not None and state.published.lineage == state.lineages[0]
    state.publish(GlobalState(5, torch.full((2,), 5.0)))
    state.publish(GlobalState(3, torch.full((2,), 3.0)))  # older: not kept
    assert state.published.round_id == 5 and state.published.lineage == UNKNOWN
    assert state.progress().state_round == 5


def test_a_peer_asking_for_an_average_waits_while_the_round_is_under_way() -> None:
    state = RoundState()
    state.set_phase(2, Phase.EXCHANGING)
    avg = Average(2, ["a", "b"], [], torch.ones(3))

    def finish() -> None:
        time.sleep(0.2)
        with state.lock:
            state.average = avg
            state.phase[2] = Phase.DONE
            state.cv.notify_all()

    t = threading.Thread(target=finish)
    t.start()
    t0 = time.monotonic()
    assert state.answer_result(2, 10.0, lambda: False) is avg
    assert time.monotonic() - t0 < 5
    t.join()
    assert state.answer_result(1, 10.0, lambda: False) is None  # not here, not under way
    state.set_phase(4, Phase.AGREEING)
    t0 = time.monotonic()
    assert state.answer_result(4, 0.2, lambda: False) is None  # waits no longer than asked
    assert state.answer_result(4, 10.0, lambda: True) is None  # the asker is gone
    assert time.monotonic() - t0 < 5


def test_a_state_answer_waits_for_a_new_enough_state_and_stop_ends_every_wait() -> None:
    state = RoundState()
    state.publish(GlobalState(1, torch.ones(2)))
    assert state.answer_state(0, 0.0).round_id == 1
    threading.Timer(0.2, state.publish, (GlobalState(3, torch.ones(2)),)).start()
    assert state.answer_state(3, 10.0).round_id == 3
    threading.Timer(0.2, state.stop).start()
    t0 = time.monotonic()
    assert state.answer_state(9, 10.0).round_id == 3 and time.monotonic() - t0 < 5
    assert state.stopping


def test_mark_finished_is_the_newest_round_done() -> None:
    state = RoundState()
    state.done_round = 6
    state.mark_finished()
    assert state.finished == 6 and state.progress().finished == 6
