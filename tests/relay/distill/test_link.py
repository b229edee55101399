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
