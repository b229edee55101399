"""An attacker with valid certificates of the job against a real relay process: oversized
declarations, chunks and control for rounds far ahead, a flood of requests and of connections.
The relay refuses and logs who, stays up, keeps averaging with its real peer, and its resident
memory (read from /proc) grows by less than 50 MB."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from helpers.relays import JOB, Job, clients, running, start_relay_process, together, wait_until

from nebula_cli.pki import client_context, wrap_client
from nebula_cli.relay.net.peers import PROTOCOL
from nebula_cli.relay.net.wire import (
    HEADER,
    MAGIC,
    WIRE_VERSION,
    Frame,
    FrameType,
    recv_frame,
    send_frame,
)

NUMEL = 50_000
RSS_BUDGET_KIB = 50 * 1024


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def relay_link(job: Job, as_cluster: str, to: str) -> ssl.SSLSocket:
    """A peer link as a relay of `as_cluster` (a valid certificate), hello done."""
    host, port = job.peer[to].rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=5)
    ctx = client_context(job.pki.relay(as_cluster), job.pki.ca_cert)
    tls, _ = wrap_client(raw, ctx, job_id=JOB, roles={"relay"}, cluster=to, timeout=5)
    cfg = job.cfg[to]
    send_frame(tls, Frame(FrameType.HELLO, {
        "role": "relay", "cluster": as_cluster, "job_id": JOB, "protocol": PROTOCOL,
        "codec": cfg.codec, "chunk_numel": cfg.chunk_numel, **cfg.codec_params.handshake(),
        "done": -1}))
    tls.settimeout(5)
    return tls


def send_quietly(sock: socket.socket, frames: list[Frame]) -> None:
    with contextlib.suppress(OSError):
        for f in frames:
            send_frame(sock, f)


def settle(link: ssl.SSLSocket) -> None:
    """Wait until the relay has read everything sent on `link` (a ping, then its pong): a
    close with unread data would reset the connection and drop what is still in flight."""
    send_frame(link, Frame(FrameType.HEARTBEAT, {"op": "ping", "id": 7}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        frame = recv_frame(link, max_payload=1 << 24)
        if frame.meta.get("op") == "pong" and frame.meta.get("id") == 7:
            return
    raise AssertionError("the relay never answered the ping")


def chunk(round_id: int, k: int, n: int) -> Frame:
    return Frame(FrameType.PEER_CHUNK, {"op": "contrib", "round": round_id, "attempt": 0,
                                        "coord": "a", "k": k, "codec": "none", "numel": n,
                                        "codec_meta": {}}, bytes(4 * n))


def test_an_attacker_with_valid_certificates_cannot_make_the_relay_hold_memory(
        tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b", "c"], round_timeout=1.0, heartbeat=0.5, dead_after=1.5)
    cfg_path, log_path = tmp_path / "relay-a.json", tmp_path / "relay-a.log"
    job.cfg["a"].dump(cfg_path)
    proc: subprocess.Popen[bytes] = start_relay_process(cfg_path, log_path)
    held: list[socket.socket] = []
    try:
        with running(job, ["b"]) as relays, clients(job, ["a", "b"]) as cls:
            wait_until(lambda: relays["b"].connected() == ["a"], 20, "b to reach a")
            for r in (0, 1):  # a's worker registers; the first round may miss the process
                xs: dict[str, Any] = {c: torch.randn(NUMEL) for c in ("a", "b")}
                warm = together(cls, r, xs)
            assert warm["a"].present == ["a", "b"]
            before = rss_kib(proc.pid)

            # 1. a frame declaring 200 MB: the link is closed before anything is allocated
            link = relay_link(job, "c", "a")
            meta = b'{"op":"contrib"}'
            with contextlib.suppress(OSError):
                link.sendall(HEADER.pack(MAGIC, WIRE_VERSION, int(FrameType.PEER_CHUNK), 0,
                                         len(meta), 200 << 20) + meta + bytes(1 << 16))
            link.close()

            # 2. chunks and round control for rounds far ahead, duplicate and out-of-range
            # chunks for the next round, a flood of state requests
            link = relay_link(job, "c", "a")
            n = job.cfg["a"].chunk_numel
            far = [chunk(10**6 + i, 0, n) for i in range(2000)]  # 8 MB, never held
            near = [chunk(2, k, n) for k in range(200)] * 3  # beyond the sync size
            control = [Frame(FrameType.ROUND, {"op": op, "round": 10**6 + i, "attempt": 0,
                                               "ok": True, "numel": NUMEL})
                       for i in range(500) for op in ("ready", "behind")]
            requests = [Frame(FrameType.STATE_REQUEST, {"op": "state", "min_round": 10**6,
                                                        "wait": 60, "req": i})
                        for i in range(200)]
            send_quietly(link, far + near + control + requests)
            settle(link)
            link.close()

            # 3. a worker certificate declaring a 2^33-element contribution
            host, port = job.work["a"].rsplit(":", 1)
            raw = socket.create_connection((host, int(port)), timeout=5)
            wctx = client_context(job.pki.worker("a", "h1"), job.pki.ca_cert)
            worker, _ = wrap_client(raw, wctx, job_id=JOB, roles={"relay"}, cluster="a",
                                    timeout=5)
            send_quietly(worker, [Frame(FrameType.CONTRIB, {"op": "allreduce", "round": 2,
                                                            "numel": 1 << 33})])
            worker.settimeout(5)
            with contextlib.suppress(OSError):
                worker.recv(4096)
            worker.close()

            # 4. a flood of 500 connections that never finish their handshake
            for _ in range(500):
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection((host, int(job.peer["a"]
                                                                    .rsplit(":", 1)[1])), 2))

            # the real peers go on averaging during the flood
            for r in (2, 3):
                xs = {c: torch.randn(NUMEL) for c in ("a", "b")}
                res = together(cls, r, xs)
                assert res["a"].present == ["a", "b"], res["a"]
                assert torch.equal(res["a"].tensor, res["b"].tensor)
            assert proc.poll() is None
            grown = rss_kib(proc.pid) - before
            print(f"relay RSS grew by {grown} KiB under attack")
            assert grown < RSS_BUDGET_KIB, grown
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)
    log = log_path.read_text()
    assert proc.returncode == 0, log[-3000:]
    assert "payload of 209715200 bytes exceeds the cap" in log
    assert "refused chunk from c: a chunk for round 1000000" in log
    assert "refused round control from c" in log
    assert "refused request from c (127.0.0.1:" in log
    assert "refused worker request from h1 (127.0.0.1:" in log
    assert "refused connection from 127.0.0.1: " in log and "handshakes in progress" in log
    assert log.count("refused connection from") < 10  # a flood makes a few lines, not 500
    assert "refused chunk from b" not in log  # c's early chunks never crowd out the real peer's
