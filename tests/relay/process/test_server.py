"""The relay for real: relay processes or in-process relays on 127.0.0.1, real mutual TLS with a
job PKI issued in tmp_path, real RelayClients. Every relay, client and process is closed in a
finally; every wait is bounded."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.relays import (
    DAY,
    Job,
    clients,
    exact_mean,
    read_jsonl,
    running,
    together,
    wait_until,
)

from nebula_cli.config.relay_config import RelayConfig, RelayConfigError
from nebula_cli.pki import client_context, issue_job_pki
from nebula_cli.relay.codecs.base import Encoded
from nebula_cli.relay.codecs.registry import get_codec
from nebula_cli.relay.net.shaping import Shaper
from nebula_cli.relay.protocol.agreement import BEHIND, Coordinator
from nebula_cli.relay.protocol.allreduce import RoundExchange, Schedule, ordered_mean

# ---------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------- config and schedule


def test_config_roundtrip_and_refusals(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b", "c"])
    cfg = job.cfg["b"]
    cfg.dump(tmp_path / "relay.json")
    again = RelayConfig.load(tmp_path / "relay.json")
    assert again == cfg
    assert (again.dials, again.accepts) == (["a"], ["c"])
    data = cfg.to_dict()
    with pytest.raises(RelayConfigError, match="unknown key"):
        RelayConfig.from_dict({**data, "colour": "blue"})
    with pytest.raises(RelayConfigError, match="peers"):
        RelayConfig.from_dict({**data, "peers": {"a": "127.0.0.1:1"}})
    with pytest.raises(RelayConfigError, match="host:port"):
        RelayConfig.from_dict({**data, "worker_listen": "nowhere"})
    with pytest.raises(RelayConfigError, match="shaping: unknown key"):
        RelayConfig.from_dict({**data, "shaping": {"rate": 10}})


def test_schedule_and_coordinator() -> None:
    s = Schedule("b", ("c", "a", "b"), 7)
    assert s.mode == "shard" and s.present == ("a", "b", "c")
    assert [s.owner(k) for k in range(4)] == ["a", "b", "c", "a"]
    assert s.contrib_targets(0) == ("a",) and s.contrib_targets(1) == ()
    assert s.avg_targets(1) == ("a", "c") and s.avg_source(2) == "c"
    d = Schedule("a", ("a", "b"), 3)
    assert d.mode == "direct" and d.contrib_targets(2) == ("b",) and d.avg_source(2) is None

    co = Coordinator("a", ["a", "b", "c"], round_timeout=2.0)
    assert co.ready(0, 0, "a", ok=True, numel=4, now=10.0, newest_done=-1) is None
    assert co.ready(0, 0, "c", ok=False, numel=4, now=10.5, newest_done=-1) is None
    assert co.due(11.9) == []
    (dec,) = co.due(12.0)
    assert (dec.present, dec.rejected, dec.missing) == (("a",), ("c",), ("b",))
    assert co.ready(0, 0, "b", ok=True, numel=4, now=12.1, newest_done=0) == dec  # late: same
    assert co.ready(1, 0, "b", ok=True, numel=4, now=13.0, newest_done=5) == BEHIND


def test_exchange_drops_a_non_finite_peer_chunk() -> None:
    """Defence in depth: a decoded chunk that is not finite is left out (both sides alike)."""
    codec = get_codec("none")
    sent: list[tuple[str, str, int]] = []
    ex = RoundExchange(Schedule("a", ("a", "b"), 2), [(0, 3), (3, 5)], encode=codec.encode,
                       decode=codec.decode, send=lambda dest, kind, k, enc: sent.append(
                           (dest, kind, k)))
    own = torch.arange(5, dtype=torch.float32)
    for k, (lo, hi) in enumerate([(0, 3), (3, 5)]):
        ex.add_own(k, codec.encode(own[lo:hi]))
    bad = torch.tensor([1.0, float("nan"), 2.0])
    ex.add_contrib("b", 0, Encoded("none", 3, {}, bytearray(bad.numpy().tobytes())))
    ex.add_contrib("b", 1, codec.encode(torch.tensor([5.0, 7.0])))
    assert ex.wait(1.0)
    assert sent == [("b", "contrib", 0), ("b", "contrib", 1)]
    assert ex.dropped == {"b"}
    expected = torch.cat([own[:3], ordered_mean({"a": own[3:], "b": torch.tensor([5.0, 7.0])})])
    assert torch.equal(ex.result, expected)


# ---------------------------------------------------------------------- averaging


def test_three_clusters_exact_mean_bit_identical(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b", "c"], codec="none")
    gen = torch.Generator().manual_seed(1)
    with running(job), clients(job) as cls:
        for r in range(2):
            numel = 5001  # 4 chunks of 1024 and a partial one: every relay owns some
            xs = {c: torch.randn(numel, generator=gen) * (i + 1) for i, c in
                  enumerate(job.clusters)}
            res = together(cls, r, xs)
            want = exact_mean(xs)
            for c in job.clusters:
                assert torch.equal(res[c].tensor, want), c
                assert res[c].present == ["a", "b", "c"] and res[c].round_id == r
                assert res[c].global_state is None
                assert res[c].bytes_sent > 0 and res[c].bytes_received > 0
    for c in job.clusters:
        lines = read_jsonl(job.cfg[c].metrics_file)
        assert [m["round"] for m in lines] == [0, 1]
        assert {m["mode"] for m in lines} == {"shard"}
        assert {"ts", "round_s", "bytes_sent", "bytes_received", "present", "missing",
                "rejected"} <= set(lines[0])
        # shard owners: each relay sends ~2(n-1)/n = 1.33 model sizes (all-to-all would be 2)
        assert lines[1]["bytes_sent"] < 1.6 * 5001 * 4, lines[1]


def test_three_clusters_int8_within_bound_and_identical(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b", "c"], codec="int8", block_size=256)
    codec = get_codec("int8", block_size=256)
    gen = torch.Generator().manual_seed(2)
    scales = {"a": 1.0, "b": 0.1, "c": 3.0}
    xs = {c: torch.randn(4000, generator=gen) * s for c, s in scales.items()}
    with running(job), clients(job) as cls:
        res = together(cls, 0, xs)
    want = exact_mean(xs)
    # each contribution is quantised once, the owner's average once more
    bound = sum(codec.max_abs_error(x) for x in xs.values()) / 3
    bound = bound + codec.max_abs_error(want + bound) + 1e-6
    for c in job.clusters:
        err = (res[c].tensor - want).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        assert torch.equal(res[c].tensor, res["a"].tensor)
    assert float((res["a"].tensor - want).abs().max()) > 0  # it did quantise


def test_three_clusters_topk_sum_sparse_parts_over_tls(tmp_path: Path) -> None:
    """topk through real relays: each cluster's top coordinates differ; every relay sends its
    encoding to both others and all three end with the exact mean of the decoded parts (every
    coordinate any cluster sent), in far fewer bytes than int8."""
    job = Job(tmp_path, ["a", "b", "c"], codec="topk", density=0.125, bits=2,
              error_feedback=True, chunk_numel=4096)
    codec = get_codec("topk", density=0.125, bits=2)
    gen = torch.Generator().manual_seed(5)
    xs = {c: torch.randn(8192, generator=gen) for c in job.clusters}
    with running(job), clients(job) as cls:
        res = together(cls, 0, xs)
    sent = {c: torch.cat([codec.decode(codec.encode(xs[c][lo:lo + 4096]))
                          for lo in range(0, 8192, 4096)]) for c in xs}
    support = torch.stack(list(sent.values())).ne(0).any(0)
    assert int(support.sum()) > 0.125 * 8192 * 2  # the clusters picked different coordinates
    for c in job.clusters:
        assert torch.equal(res[c].tensor, exact_mean(sent))
    lines = read_jsonl(job.cfg["a"].metrics_file)
    assert lines[0]["mode"] == "direct"
    # int8's shard mode sends ~1.33 x 8192 bytes here; topk 2 of 16 in 2 bits is 1/36 of fp32
    # per contribution, sent to both others (plus four frames' headers)
    assert lines[0]["bytes_sent"] < 8192 * 1.33 / 4, lines[0]


def test_two_clusters_direct_several_rounds(tmp_path: Path) -> None:
    job = Job(tmp_path, ["east", "west"], codec="int8")
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(3)
    with running(job) as relays, clients(job) as cls:
        for r in range(4):
            xs = {c: torch.randn(3000, generator=gen) for c in job.clusters}
            res = together(cls, r, xs)
            # both relays average the same decoded encodings: identical, and equal to the
            # mean of the decoded contributions
            dec = {c: torch.cat([codec.decode(codec.encode(xs[c][lo:lo + 1024]))
                                 for lo in range(0, 3000, 1024)]) for c in xs}
            assert torch.equal(res["east"].tensor, res["west"].tensor)
            assert torch.equal(res["east"].tensor, exact_mean(dec))
            assert res["west"].present == ["east", "west"]
        status = json.loads(Path(job.cfg["east"].status_file).read_text())
        # after a round each relay gives back what it freed (nebula_cli.heap), on its ticker
        wait_until(lambda: all(r.heap.trims >= 1 for r in relays.values()), 5, "trims")
    lines = read_jsonl(job.cfg["east"].metrics_file)
    assert [m["mode"] for m in lines] == ["direct"] * 4
    # int8: ~1 byte per element each way (plus scales and frames), not 4
    assert all(3000 < m["bytes_sent"] < 3000 * 2 for m in lines), lines
    assert status["state"] == "running" and status["round"] == 3
    assert status["peers"]["west"]["connected"] is True
    assert status["rounds"] == 4 and status["bytes_sent"] >= sum(m["bytes_sent"] for m in lines)


def test_non_finite_update_is_rejected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nebula")
    job = Job(tmp_path, ["a", "b", "c"])
    xs = {c: torch.randn(3000) for c in job.clusters}
    xs["b"][17] = float("nan")
    xs["b"][2500] = float("inf")
    with running(job), clients(job) as cls:
        res = together(cls, 0, xs)
        good = {c: xs[c] for c in ("a", "c")}
        for c in job.clusters:
            assert torch.equal(res[c].tensor, exact_mean(good)), c
            assert bool(torch.isfinite(res[c].tensor).all())
            assert res[c].present == ["a", "c"] and res[c].rejected == ["b"]
        # the next round is whole again: nothing was poisoned
        ys = {c: torch.randn(3000) for c in job.clusters}
        again = together(cls, 1, ys)
        assert torch.equal(again["b"].tensor, exact_mean(ys))
    assert "local contribution rejected (non-finite" in caplog.text
    assert read_jsonl(job.cfg["a"].metrics_file)[0]["rejected"] == ["b"]
    assert json.loads(Path(job.cfg["b"].status_file).read_text())["rejected"] >= 1


def test_non_finite_update_with_no_peer_gives_zero(tmp_path: Path) -> None:
    job = Job(tmp_path, ["solo"])
    with running(job), clients(job) as cls:
        res = cls["solo"].allreduce(0, torch.tensor([1.0, float("nan"), 3.0]))
        assert res.present == [] and res.rejected == ["solo"]
        assert torch.equal(res.tensor, torch.zeros(3))
        ok = cls["solo"].allreduce(1, torch.tensor([1.0, 2.0, 3.0]))
        assert ok.present == ["solo"] and torch.equal(ok.tensor, torch.tensor([1.0, 2.0, 3.0]))


def test_late_cluster_is_left_out_and_gets_the_average(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b"], round_timeout=1.0)
    xs = {"a": torch.randn(2000), "b": torch.randn(2000)}
    with running(job), clients(job) as cls:
        t0 = time.monotonic()
        res = together(cls, 0, xs, delays={"b": 2.0})
        assert res["a"].present == ["a"] and res["a"].missing == ["b"]
        assert 0.9 < res["a"].seconds < 3.0
        assert torch.equal(res["a"].tensor, xs["a"])
        assert torch.equal(res["b"].tensor, xs["a"])  # same average: b stays in step
        assert res["b"].present == ["a"] and res["b"].global_state is None
        both = together(cls, 1, xs)
        assert both["a"].present == ["a", "b"]
        assert time.monotonic() - t0 < 10
    status = json.loads(Path(job.cfg["a"].status_file).read_text())
    assert status["missed"] == 1 and status["partial_rounds"] == 1


# ---------------------------------------------------------------------- security


def tls_attempt(addr: str, ctx: Any) -> str:
    """Connect with ``ctx``; return how the relay answered ('refused: ...' or 'open')."""
    host, port = addr.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=5)
    try:
        s = ctx.wrap_socket(raw)
        raw = s
        s.settimeout(5)
        s.sendall(b"NBL1")
        data = s.recv(1)  # TLS 1.3: a refusal of our certificate shows up on the first read
        return "open" if data else "refused: closed"
    except OSError as exc:
        return f"refused: {exc}"
    finally:
        raw.close()


def test_wrong_certificates_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="nebula")
    job = Job(tmp_path, ["a", "b"])
    other = issue_job_pki("other-job", {"b": ["h0"]}, tmp_path / "other", valid_for=DAY)
    with running(job) as relays, clients(job) as cls:
        foreign = client_context(other.relay("b"), other.ca_cert)  # trusts the other CA
        foreign.load_verify_locations(cafile=str(job.pki.ca_cert))
        worker = client_context(job.pki.worker("b", "h0"), job.pki.ca_cert)
        relay_b = client_context(job.pki.relay("b"), job.pki.ca_cert)
        stranger = client_context(job.pki.worker("b", "h1"), job.pki.ca_cert)
        assert tls_attempt(job.peer["a"], foreign).startswith("refused")
        assert tls_attempt(job.peer["a"], worker).startswith("refused")
        assert tls_attempt(job.work["a"], relay_b).startswith("refused")
        assert tls_attempt(job.work["a"], stranger).startswith("refused")
        text = caplog.text
        assert "not issued by this job's CA" in text
        assert "worker certificate presented where a relay is required" in text
        assert "relay certificate presented where a worker is required" in text
        assert "certificate of cluster b, expected a" in text
        assert text.count("rejected TLS peer 127.0.0.1:") >= 4
        # still serving, and still linked to its real peer
        xs = {"a": torch.ones(10), "b": torch.zeros(10)}
        res = together(cls, 0, xs)
        assert torch.equal(res["a"].tensor, torch.full((10,), 0.5))
        assert relays["a"].connected() == ["b"]


# ---------------------------------------------------------------------- shaping


def test_shaper_rate_and_round_trip_delay(tmp_path: Path) -> None:
    rate_mbit, total = 40.0, 2_500_000  # ~0.5 s at 40 Mbit/s
    ls = socket.create_server(("127.0.0.1", 0))
    got: list[tuple[float, int]] = []

    def sink() -> None:
        conn, _ = ls.accept()
        with conn:
            n = 0
            while n < total:
                data = conn.recv(1 << 16)
                if not data:
                    break
                n += len(data)
                got.append((time.monotonic(), n))

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    out = socket.create_connection(ls.getsockname())
    try:
        shaper = Shaper(rate_mbit, 0)
        payload = memoryview(bytearray(total))
        for off in range(0, total, 1 << 20):
            shaper.send(out.sendall, [payload[off:off + (1 << 20)]], shaper.stamp())
        t.join(10)
    finally:
        out.close()
        ls.close()
    (t_first, n_first), (t_last, n_last) = got[0], got[-1]
    measured = (n_last - n_first) * 8 / (t_last - t_first) / 1e6
    assert n_last == total
    assert abs(measured - rate_mbit) / rate_mbit < 0.15, measured

    job = Job(tmp_path, ["a", "b"], shaping={"rate_mbit": 40.0, "delay_ms": 100.0})
    with running(job) as relays:
        wait_until(lambda: relays["b"].connected() == ["a"], 10, "the link")
        rtts = [relays["b"].ping("a") for _ in range(3)]
        assert min(rtts) >= 0.2, rtts
        assert max(rtts) < 1.0, rtts
