"""The relays' AES-GCM records (relay.records), for real: records over TCP sockets on loopback,
altered, replayed, oversized and cut records; and two relays whose link runs on records, one
of them through a proxy that flips a byte of a chunk in flight. Sockets, proxies and relays are
closed in a finally."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.relays import Job, clients, exact_mean, running

from nebula_cli.relay.net import gcm_records as records
from nebula_cli.relay.net.gcm_records import MAX_RECORD, RecordConn, RecordError
from nebula_cli.relay.net.wire import ConnectionClosed


@contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


BINDING = os.urandom(48)  # a TLS session's channel binding (tests/relay/net/test_gcm_records.py)


def conns(a: socket.socket, b: socket.socket) -> tuple[RecordConn, RecordConn]:
    ka, kb = os.urandom(32), os.urandom(32)
    return RecordConn(a, ka, kb, binding=BINDING), RecordConn(b, kb, ka, binding=BINDING)


def read_all(conn: RecordConn, n: int, step: int | None = None) -> bytearray:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = conn.recv_into(view[got:], min(step or n, n - got))
        assert k, f"end of stream after {got} of {n} bytes"
        got += k
    return out


@pytest.mark.parametrize("into", [True, False], ids=["into buffers", "cryptography < 47"])
def test_records_carry_any_sizes_in_any_read_sizes(into: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if into and not records._INTO:
        pytest.skip("this cryptography has no encrypt_into (the other case runs)")
    monkeypatch.setattr(records, "_INTO", into)
    with tcp_pair() as (a, b):
        tx, rx = conns(a, b)
        data = os.urandom(MAX_RECORD + 12345)  # two records, the first at the largest size
        small = [os.urandom(n) for n in (1, 7, 4096)]
        sender = threading.Thread(target=lambda: [tx.sendall(x) for x in (*small, b"", data)])
        sender.start()
        try:
            for x in small:  # read a byte at a time: the rest of a record waits for the next read
                assert read_all(rx, len(x), step=1) == x
            assert read_all(rx, len(data)) == data  # straight into the buffer, no copy
        finally:
            sender.join(30)
        a.shutdown(socket.SHUT_WR)
        assert rx.recv_into(bytearray(10)) == 0  # the end of the stream between records


def test_altered_replayed_reordered_and_oversized_records_are_refused() -> None:
    with tcp_pair() as (a, b):
        key_tx, key_rx = os.urandom(32), os.urandom(32)
        tx = RecordConn(a, key_tx, key_rx, binding=BINDING)
        # capture the bytes of two records as they would cross the wire
        wire_a, wire_b = socket.socketpair()
        with wire_a, wire_b:
            cap = RecordConn(wire_a, key_tx, key_rx, binding=BINDING)
            cap.sendall(b"first record")
            cap.sendall(b"second record")
            raw = wire_b.recv(1 << 16)
        first, second = raw[: 4 + 12 + 16], raw[4 + 12 + 16:]
        assert len(second) == 4 + 13 + 16

        def receiver() -> RecordConn:
            return RecordConn(b, key_rx, key_tx, binding=BINDING)

        rx = receiver()
        a.sendall(second)  # out of order: record 1 where record 0 is due
        with pytest.raises(RecordError, match="failed authentication"):
            rx.recv_into(bytearray(64))
        rx = receiver()
        altered = bytearray(first)
        altered[10] ^= 1
        a.sendall(bytes(altered))
        with pytest.raises(RecordError, match="failed authentication"):
            rx.recv_into(bytearray(64))
        rx = receiver()
        a.sendall(first + first)  # a replay of record 0
        assert bytes(read_all(rx, 12)) == b"first record"
        with pytest.raises(RecordError, match="failed authentication"):
            rx.recv_into(bytearray(64))
        rx = receiver()
        a.sendall((MAX_RECORD + 1).to_bytes(4, "big"))  # refused before anything is read
        with pytest.raises(RecordError, match="at most"):
            rx.recv_into(bytearray(64))
        del tx


def test_a_record_cut_short_is_an_error_and_keys_are_updated_in_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "REKEY_BYTES", 1000)
    with tcp_pair() as (a, b):
        tx, rx = conns(a, b)
        first_key = tx._tx.key
        for i in range(6):  # 600 bytes a record: a new key after every second record
            tx.sendall(bytes([i]) * 600)
        for i in range(6):
            assert read_all(rx, 600) == bytes([i]) * 600
        assert tx._tx.key != first_key and rx._rx.key == tx._tx.key
        a.sendall((100).to_bytes(4, "big") + b"x" * 50)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionClosed, match="inside a record"):
            rx.recv_into(bytearray(200))


def test_offers_name_the_cipher_and_a_key_of_the_right_size() -> None:
    key, meta = records.offer()
    assert len(key) == records.KEY_BYTES and records.accepted(meta) == key
    assert records.accepted({"cipher": "aes-128-cbc", "key": meta["key"]}) is None
    assert records.accepted({"cipher": records.CIPHER, "key": "00ff"}) is None
    assert records.accepted(None) is None
    with pytest.raises(RecordError, match="different keys"):
        RecordConn(socket.socket(), key, key, binding=BINDING)


class FlipProxy:
    """A TCP proxy on loopback that flips one byte of what the dialer's peer sends it, once,
    after ``after`` bytes (past the handshake: inside a chunk)."""

    def __init__(self, target: str, after: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.after = after
        self.flipped = threading.Event()
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.ls.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                down, _ = self.ls.accept()
                up = socket.create_connection(self.target)
            except OSError:
                return
            self.socks += [down, up]
            threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(down, up, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip and not self.flipped.is_set() and seen + len(data) > self.after:
                    buf = bytearray(data)
                    buf[self.after - seen] ^= 0x40
                    data = bytes(buf)
                    self.flipped.set()
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.stop.set()
        self.ls.close()
        for s in self.socks:
            s.close()


def test_relays_link_on_records_and_a_byte_changed_in_flight_closes_the_link(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Cluster b dials a through a proxy that flips one byte inside a chunk: the receiving
    relay refuses the record, the link closes and comes back (on records again), the clusters
    recover as after any lost link (the one that diverged takes the other's state), and they
    end with the same state, averaging together again."""
    caplog.set_level(logging.INFO, logger="nebula.relay")
    job = Job(tmp_path, ["a", "b"], chunk_numel=1 << 16)
    proxy = FlipProxy(job.peer["a"], after=600_000)
    n = 300_000
    theta = {c: torch.zeros(n) for c in job.clusters}
    try:
        job.cfg["b"] = dataclasses.replace(job.cfg["b"], peers={"a": proxy.addr})
        with running(job) as relays, clients(job) as cls:

            def step(c: str, r: int, x: torch.Tensor) -> Any:
                """A worker's round: the average applied (or the state taken), then published."""
                res = cls[c].allreduce(r, x)
                if res.global_state is not None:
                    theta[c] = res.global_state.clone()
                else:
                    theta[c] -= res.tensor
                cls[c].publish_state(res.round_id, theta[c])
                return res

            last: dict[str, Any] = {}
            deadline, r = time.monotonic() + 60, 0
            while True:  # rounds go on alone while the link is down; then one joint round
                xs = {c: torch.randn(n) for c in job.clusters}
                with ThreadPoolExecutor(2) as pool:
                    futs = {c: pool.submit(step, c, r, xs[c]) for c in job.clusters}
                    last = {c: f.result(timeout=60) for c, f in futs.items()}
                joint = all(last[c].present == ["a", "b"] for c in job.clusters)
                if (r >= 2 and joint and proxy.flipped.is_set()) or time.monotonic() > deadline:
                    break
                r += 1
                time.sleep(0.1 if proxy.flipped.is_set() else 0)
            assert proxy.flipped.is_set()
            assert torch.equal(theta["a"], theta["b"])
            assert joint, f"no joint round in 60 s after the flip (round {r})"
            for c in job.clusters:  # the last round: both present, the exact mean
                assert torch.equal(last[c].tensor, exact_mean(xs))
            links = [relays[c].peers.link(o) for c, o in (("a", "b"), ("b", "a"))]
            assert all(lk is not None and lk.records for lk in links)
            assert any(lk is not None and lk.buffers.reused for lk in links)
    finally:
        proxy.close()
    assert "failed authentication" in caplog.text
    assert caplog.text.count("AES-GCM records") >= 4  # both ends, before and after
