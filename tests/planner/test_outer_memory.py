"""The outer step's memory model (planner/outer_memory.py): copies of the shard per role, what
one host needs, and the refusal's number and fixes."""

from __future__ import annotations

from nebula_cli.planner.outer_memory import (
    COPIES,
    FIXES,
    FP32_BYTES,
    SHARED_COPIES,
    WHOLE_COPIES,
    ProcessRole,
    cluster_memory,
    gib,
    host_need,
    job_memory,
    process_memory,
    refusal,
)

PARAMS = 85_000_000


def test_each_role_holds_its_copies_of_the_shard() -> None:
    for role in ProcessRole:
        p = process_memory(PARAMS, 2, role)
        # the ranks own half the vector each (runtime/shard.py); the relay all of it
        whole = role is ProcessRole.RELAY
        assert p.shard_bytes == (PARAMS if whole else PARAMS // 2) * FP32_BYTES
        assert p.own_bytes == int(COPIES[role] * p.shard_bytes
                                  + WHOLE_COPIES[role] * PARAMS * FP32_BYTES)
        assert p.shared_bytes == int(SHARED_COPIES[role] * p.shard_bytes)
        assert p.total_bytes == p.own_bytes + p.shared_bytes
    assert process_memory(2 * PARAMS, 2, ProcessRole.RELAY).total_bytes == \
        2 * process_memory(PARAMS, 2, ProcessRole.RELAY).total_bytes


def test_a_ranks_memory_falls_with_the_clusters_ranks() -> None:
    """Other ranks hold copies of their shard only; rank 0 adds its hop's whole copies."""
    rank = [process_memory(PARAMS, n, ProcessRole.RANK).total_bytes for n in (2, 4, 8)]
    assert rank[0] > rank[1] > rank[2] and abs(rank[0] - 4 * rank[2]) <= 9 * 4 * 8
    rank0 = process_memory(PARAMS, 8, ProcessRole.RANK0).total_bytes
    assert rank0 > int(WHOLE_COPIES[ProcessRole.RANK0] * PARAMS * FP32_BYTES)


def test_a_one_rank_cluster_has_no_other_ranks() -> None:
    assert [p.role for p in cluster_memory(PARAMS, 1)] == [ProcessRole.RELAY, ProcessRole.RANK0]
    assert [p.role for p in cluster_memory(PARAMS, 4)] == list(ProcessRole)
    (east, west) = job_memory(PARAMS, {"east": 1, "west": 3})
    assert (east.cluster, east.ranks, west.ranks) == ("east", 1, 3)
    data = west.to_json()
    assert [p["role"] for p in data["processes"]] == [r.value for r in ProcessRole]


def test_a_host_needs_its_ranks_and_its_relay() -> None:
    rank0, rank, relay = (process_memory(PARAMS, 4, r).total_bytes
                          for r in (ProcessRole.RANK0, ProcessRole.RANK, ProcessRole.RELAY))
    assert host_need(PARAMS, 4, 2, 0, relay=True) == rank0 + rank + relay
    assert host_need(PARAMS, 4, 2, 2, relay=False) == 2 * rank


def test_the_refusal_names_the_numbers_and_the_fixes() -> None:
    assert refusal("east/a", 10, 10, PARAMS) is None
    need, have = 5 << 30, 3 << 30
    message = refusal("east/a", need, have, PARAMS)
    assert message is not None and message.startswith("east/a: ")
    assert gib(need) in message and gib(have) in message and f"{PARAMS:,}" in message
    assert all(fix in message for fix in FIXES)
