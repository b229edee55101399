"""A label link's bounded sender (`relay.distill.link`), over real TLS on loopback: a student
that keeps its link alive (heartbeats) but stops reading holds up nobody else: another
student's asks are answered meanwhile, and the relay ends the link that reads nothing once a
frame has waited ``dead_after`` for it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import numpy as np
from helpers.jobs import wait_for
from helpers.label_teacher import (
    JOB,
    job_pki,
    label_client,
    label_relay,
    serve_link,
    serving,
    worker_ctx,
)

from nebula_cli.pki import wrap_client
from nebula_cli.relay.distill.idpack import pack_ids
from nebula_cli.relay.distill.messages import LabelAsk, LabelHello, Side
from nebula_cli.relay.net.duplex import DuplexTLS
from nebula_cli.relay.net.wire import Frame, FrameType, recv_frame, send_frame

ASKS = 300
"""The stuck student's asks: their answers (~15 KB each) fill loopback's socket buffers."""


def test_a_student_that_stops_reading_stalls_nobody_and_is_ended(tmp_path: Path) -> None:
    pki = job_pki(tmp_path / "pki")
    relay = label_relay(pki, max_asks=ASKS)
    done = threading.Event()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(5)
    raw.connect(("127.0.0.1", relay.port))
    tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s2"), job_id=JOB, roles={"relay"})
    client = None
    try:
        with serving(serve_link(f"127.0.0.1:{relay.port}", pki, "lab", "t1", JOB)):
            send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT, rank=1).to_frame())
            assert recv_frame(tls).type is FrameType.WELCOME
            ids = np.arange(1024) % 4000
            for seq in range(ASKS):  # then it reads nothing more
                send_frame(tls, LabelAsk(seq=seq, tokens=1024, width=512,
                                         bits=12).to_frame(pack_ids(ids, 12)))

            def beat() -> None:  # alive, as far as heartbeats go
                while not done.wait(0.2):
                    with contextlib.suppress(OSError):
                        send_frame(tls, Frame(FrameType.HEARTBEAT))

            threading.Thread(target=beat, daemon=True).start()
            assert wait_for(lambda: relay.counts().answers > 50)  # its answers pile up
            client = label_client(pki, {"lab": f"127.0.0.1:{relay.port}"})
            start = time.monotonic()
            for seq in range(5):
                client.ask(seq, np.arange(16) + seq)
            for seq in range(5):
                assert client.take(seq, 10) is not None, f"no answer to {seq}"
            assert time.monotonic() - start < 5.0
            assert wait_for(lambda: relay.counts().students == 1, timeout=10)  # ended
            assert client.live() == ["lab"] and client.resent == 0
    finally:
        done.set()
        tls.close()
        if client is not None:
            client.close()
        relay.close()


def test_a_student_refused_while_it_still_sends_reads_why_and_its_sends_do_not_fail(
        tmp_path: Path) -> None:
    """A link ended with a refusal (past its asks) while its student keeps sending: the relay
    ends its side first and reads away the rest (`close_after_refusal`), so neither the
    student's sends fail on a reset nor is the refusal lost (its sends had failed with "EOF
    occurred in violation of protocol" once the relay closed with their bytes unread)."""
    pki = job_pki(tmp_path / "pki")
    relay = label_relay(pki, dead_after=30.0)
    payload = pack_ids(np.arange(1024) % 16, 4)
    try:
        for _ in range(3):
            raw = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            tls, _ = wrap_client(raw, worker_ctx(pki, "cloud", "s1"), job_id=JOB,
                                 roles={"relay"})
            tls.settimeout(5)
            send_frame(tls, LabelHello(job=JOB, side=Side.STUDENT).to_frame())
            held = recv_frame(tls).meta["max_asks"]
            io, failed = DuplexTLS(tls), []

            def flood(io: DuplexTLS = io, failed: list[Exception] = failed,
                      held: int = held) -> None:
                try:  # far more than the link may hold, sent while the relay refuses it
                    for seq in range(held + 2000):
                        send_frame(io, LabelAsk(seq=seq, tokens=1024, width=8,
                                                bits=4).to_frame(payload))
                except Exception as exc:  # noqa: BLE001 - what the test counts
                    failed.append(exc)

            sender = threading.Thread(target=flood)
            sender.start()
            try:
                got = recv_frame(io)
                while got.type is FrameType.HEARTBEAT:
                    got = recv_frame(io)
            finally:
                sender.join(30)
                tls.close()
            assert got.type is FrameType.ERROR
            assert got.meta["reason"].startswith(f"more than {held} asks outstanding")
            assert failed == [], failed
    finally:
        relay.close()
