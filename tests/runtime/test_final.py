"""runtime/final.py: the end's agreement on one final state. Rank 0 waits for its relay's
answer while the cluster's other ranks hear from it on every beat: two real gloo ranks whose
process group times out after 3 s wait 8 s for a late answer and both take the state; a stop
asked of one rank during the wait ends it on both at once. One rank on its own: a relay
without the question, and one whose answer fails."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.gloo_ranks import run_ranks

from nebula_cli.runtime.cluster_share import ClusterShare
from nebula_cli.runtime.final import final_agreement

RANK = r"""
import datetime, json, sys, threading, time
import torch, torch.distributed as dist
from nebula_cli.runtime.cluster_share import ClusterShare
from nebula_cli.runtime.final import final_agreement
rank, store, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))  # after the
# slow start-ups, which the 3 s would otherwise have to cover

class Relay:
    def final_state(self, wait):
        if case == "late":  # the other cluster finishes long after the group's timeout
            time.sleep(8)
            return 5, torch.arange(4.0), torch.ones(4)
        threading.Event().wait()  # "stop": no answer before the stop

got = {}
def apply(shared):
    got.update(round=shared.round_id, state=shared.state.tolist(),
               momentum=shared.momentum.tolist())
    return True

t0 = time.monotonic()
asked = lambda: case == "stop" and rank == 1 and time.monotonic() - t0 > 2
out = final_agreement(Relay() if rank == 0 else None, ClusterShare(rank, 2, group, 4), apply,
                      lambda: got.update(written=True), {"final_round": True}, asked, beat=0.5)
seconds = time.monotonic() - t0
dist.destroy_process_group()
print(json.dumps({"out": out, "got": got, "seconds": seconds}))
"""


def two_ranks(tmp_path: Path, case: str) -> list[dict[str, Any]]:
    return run_ranks(RANK, tmp_path / "store", case)


def test_a_wait_longer_than_the_groups_timeout_ends_with_the_state_on_every_rank(
        tmp_path: Path) -> None:
    said = two_ranks(tmp_path, "late")
    for s in said:
        assert s["out"] == {"final_round": True, "final_state_round": 5}
        assert s["got"] == {"round": 5, "state": [0.0, 1.0, 2.0, 3.0],
                            "momentum": [1.0, 1.0, 1.0, 1.0], "written": True}
        assert s["seconds"] > 5.0  # well past the 3 s after which a collective times out


def test_a_stop_asked_of_any_rank_ends_the_wait_on_every_rank(tmp_path: Path) -> None:
    said = two_ranks(tmp_path, "stop")
    for s in said:
        assert s["out"] == {"final_round": True}  # no state: the cluster keeps its own
        assert s["got"] == {}
        assert 2.0 <= s["seconds"] < 10.0  # the relay never answered


def one_rank(averager: Any, stats: dict[str, Any] | None) -> dict[str, Any] | None:
    def apply(shared: Any) -> bool:
        raise AssertionError("nothing to apply")

    return final_agreement(averager, ClusterShare(0, 1, None, 4), apply, lambda: None, stats,
                           beat=0.05)


def test_a_relay_without_the_question_keeps_the_clusters_own() -> None:
    assert one_rank(SimpleNamespace(), {"final_round": True}) == {"final_round": True}
    assert one_rank(None, None) is None


def test_with_no_thread_to_be_had_rank_0_asks_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter shutdown (the hook's end, in atexit) Python 3.12 may refuse new threads:
    rank 0 then asks in its own thread, and the other ranks wait in the first beat."""
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    taken: list[Any] = []
    answer = SimpleNamespace(final_state=lambda wait: (7, torch.arange(4.0), None))
    out = final_agreement(answer, ClusterShare(0, 1, None, 4), lambda s: taken.append(s) or True,
                          lambda: None, {}, beat=0.05)
    assert out == {"final_state_round": 7} and taken[0].state.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_failed_answer_keeps_the_clusters_own_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    def final_state(wait: float | None) -> tuple[int, torch.Tensor, None]:
        raise ConnectionError("relay gone")

    with caplog.at_level(logging.WARNING, logger="nebula.sync"):
        assert one_rank(SimpleNamespace(final_state=final_state), {"a": 1}) == {"a": 1}
    assert "could not agree on the final state with the other clusters: relay gone" in caplog.text


def test_an_answer_that_says_keep_your_own_takes_nothing() -> None:
    assert one_rank(SimpleNamespace(final_state=lambda wait: (None, None, None)), {}) == {}
