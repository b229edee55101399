"""The coordinator of a round (relay.protocol.agreement): nobody waits for a cluster that is
already past the round."""

from __future__ import annotations

from nebula_cli.relay.protocol.agreement import Coordinator, Decision


def test_a_cluster_ready_for_a_later_round_is_not_waited_for_in_an_earlier_one() -> None:
    """After `nebula stop` + `resume` the clusters can restart one round apart (east ran a last
    round alone when it was stopped; west had just synced): east asks for round 4, west for
    round 3. West's round 3 is decided at once, without east, instead of at the deadline;
    east's round 4 then waits for west as any round does."""
    co = Coordinator("east", ["east", "west"], round_timeout=120.0)
    assert co.ready(4, 0, "east", ok=True, numel=8, now=0.0, newest_done=-1) is None
    three = co.ready(3, 0, "west", ok=True, numel=8, now=1.0, newest_done=-1)
    assert isinstance(three, Decision)
    assert (three.round, three.present, three.missing) == (3, ("west",), ("east",))
    assert co.due(60.0) == []  # round 4 is still open: west comes to it
    four = co.ready(4, 0, "west", ok=True, numel=8, now=10.0, newest_done=3)
    assert isinstance(four, Decision) and four.present == ("east", "west")


def test_a_round_opened_before_the_cluster_said_it_was_past_it_is_completed_then() -> None:
    """West's READY for round 3 came first; east's for round 4 then shows east will never be
    ready for 3: `complete` (called after every READY) decides round 3 without waiting."""
    co = Coordinator("east", ["east", "west"], round_timeout=120.0)
    assert co.ready(3, 0, "west", ok=True, numel=8, now=0.0, newest_done=-1) is None
    assert co.complete(["east", "west"]) == []  # east has said nothing yet: wait for it
    assert co.ready(4, 0, "east", ok=True, numel=8, now=1.0, newest_done=-1) is None
    (three,) = co.complete(["east", "west"])
    assert (three.round, three.present) == (3, ("west",))
    assert co.complete(["east", "west"]) == []


def test_in_step_clusters_still_wait_for_each_other() -> None:
    co = Coordinator("east", ["east", "west"], round_timeout=120.0)
    assert co.ready(0, 0, "east", ok=True, numel=8, now=0.0, newest_done=-1) is None
    assert co.complete(["east", "west"]) == []
    (late,) = co.due(120.0)  # west never came: the deadline decides, as before
    assert late.present == ("east",) and late.missing == ("west",)
    # a cluster restarted from an older checkpoint says an earlier round again: it is waited
    # for there (its newest READY is what counts, not the highest it ever said)
    co = Coordinator("east", ["east", "west"], round_timeout=120.0)
    co.ready(5, 0, "west", ok=True, numel=8, now=0.0, newest_done=-1)
    co.ready(2, 0, "west", ok=True, numel=8, now=1.0, newest_done=-1)
    assert co.ready(3, 0, "east", ok=True, numel=8, now=2.0, newest_done=-1) is None
    (two,) = co.complete(["east", "west"])  # east is past round 2; west comes to 3
    assert (two.round, two.present) == (2, ("west",))
    assert co.complete(["east", "west"]) == []
