"""The relays' AES-GCM records (nebula_cli.relay.net.gcm_records) as TLS 1.3 would make them:
keys derived from both relays' shares and the TLS session they met in (a real mutual-TLS
handshake with the job's certificates, then close_notify both ways); the same shares in another
session give other keys; the shares are not the keys and the first nonce is not zero; and a
second thread writing (or reading) one connection fails instead of reusing a nonce.
(Records' framing, tampering and key updates: tests/relay/net/test_gcm_records_links.py.)"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from nebula_cli.pki import client_context, issue_job_pki, server_context, wrap_client, wrap_server
from nebula_cli.relay.net import gcm_records as records
from nebula_cli.relay.net.gcm_records import RecordConn, RecordError

JOB = "job-records"


@pytest.fixture(scope="module")
def contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    job = issue_job_pki(JOB, {"a": [], "b": []}, tmp_path_factory.mktemp("pki") / "job",
                        valid_for=datetime.timedelta(days=1))
    return (server_context(job.relay("a"), job.ca_cert),
            client_context(job.relay("b"), job.ca_cert))


@contextmanager
def unwrapped_pair(contexts: tuple) -> Iterator[tuple[records.Unwrapped, records.Unwrapped]]:
    """Both ends of one mutual-TLS connection after TLS closed, as two relays have them."""
    server_ctx, client_ctx = contexts
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, ThreadPoolExecutor(1) as pool:
        def accept() -> records.Unwrapped:
            raw, _ = listener.accept()
            tls, _ = wrap_server(raw, server_ctx, job_id=JOB, roles={"relay"}, timeout=5)
            return records.unwrap(tls)

        served = pool.submit(accept)
        raw = socket.create_connection(listener.getsockname(), timeout=5)
        tls, _ = wrap_client(raw, client_ctx, job_id=JOB, roles={"relay"}, timeout=5)
        dialer = records.unwrap(tls)
        acceptor = served.result(timeout=10)
    try:
        yield dialer, acceptor
    finally:
        dialer.sock.close()
        acceptor.sock.close()


def test_keys_come_from_both_shares_and_the_tls_session(contexts: tuple) -> None:
    share_d, _ = records.offer()
    share_a, _ = records.offer()
    with unwrapped_pair(contexts) as (d, a), unwrapped_pair(contexts) as (d2, a2):
        assert d.binding == a.binding and d.binding != d2.binding  # one per TLS session
        dialer, acceptor = RecordConn(d, share_d, share_a), RecordConn(a, share_a, share_d)
        dialer.sendall(b"round 1 chunk")
        got = bytearray(13)
        assert acceptor.recv_into(got) == 13 and got == b"round 1 chunk"
        assert dialer._tx.key == acceptor._rx.key
        assert dialer._tx.key not in (share_d, share_a)  # the shares are not the keys
        assert dialer._tx.key != dialer._rx.key  # one key per direction
        assert dialer._tx.nonce(0) != bytes(12)  # counter XOR an IV, not the bare counter
        # the same shares replayed into another session: keys made for the first session
        # authenticate nothing in the second
        replay = RecordConn(d2.sock, share_d, share_a, binding=d.binding)
        replay.sendall(b"replayed")
        with pytest.raises(RecordError, match="failed authentication"):
            RecordConn(a2, share_a, share_d).recv_into(bytearray(8))


def test_a_second_writer_or_reader_fails_instead_of_reusing_a_nonce(contexts: tuple) -> None:
    share_d, _ = records.offer()
    share_a, _ = records.offer()
    with unwrapped_pair(contexts) as (d, a):
        dialer, acceptor = RecordConn(d, share_d, share_a), RecordConn(a, share_a, share_d)
        big = os.urandom(64 << 20)  # more than the socket buffers: the first writer blocks
        first = threading.Thread(target=dialer.sendall, args=(big,), daemon=True)
        first.start()
        while first.is_alive() and dialer._tx.seq == 0:
            threading.Event().wait(0.01)  # until it is inside its first record
        with pytest.raises(RecordError, match="two threads write"):
            dialer.sendall(b"a second writer")
        got = bytearray(len(big))
        view, n = memoryview(got), 0
        while n < len(big):
            k = acceptor.recv_into(view[n:])
            assert k
            n += k
        first.join(30)
        assert got == big  # the first writer's records, whole and in order
        blocked = threading.Thread(target=acceptor.recv_into, args=(bytearray(8),),
                                   daemon=True)
        blocked.start()  # a reader waiting for the next record
        while blocked.is_alive() and not acceptor._rx_lock.locked():
            threading.Event().wait(0.01)
        with pytest.raises(RecordError, match="two threads read"):
            acceptor.recv_into(bytearray(8))
        dialer.sendall(b"wake it")
        blocked.join(10)
        assert not blocked.is_alive()


def test_an_offer_from_a_relay_of_the_earlier_scheme_keeps_tls() -> None:
    share, meta = records.offer()
    assert records.accepted(meta) == share and meta["cipher"] == records.CIPHER
    assert records.accepted({"cipher": "aes-256-gcm", "key": share.hex()}) is None
    with socket.socket() as sock, pytest.raises(RecordError, match="channel binding"):
        RecordConn(sock, share, os.urandom(32))
