"""The worker hop on the relay's own host, for real: relays on 127.0.0.1 with their Unix
sockets, RelayClients that connect there (tensors in sealed memfds) or over mutual TLS, raw
connections that break the rules, and a process of another uid (root drops its privileges in a
forked child). Every relay, client and child is closed or reaped in a finally."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.relays import Job, exact_mean, running, together

from nebula_cli.relay.net import local_socket as local
from nebula_cli.relay.net.framing import recv_tensor, send_tensor, tensor_frames
from nebula_cli.relay.net.schema import encode
from nebula_cli.relay.net.wire import (
    LINGER_BYTES,
    ConnectionClosed,
    Frame,
    FrameType,
    encode_frame,
    recv_frame,
)
from nebula_cli.relay.process.client import RelayClient, RelayError
from nebula_cli.relay.process.server import Relay
from nebula_cli.relay.process.worker_messages import Contrib

pytestmark = pytest.mark.skipif(not local.supported(), reason="Linux only (memfd, SO_PEERCRED)")


def with_sockets(job: Job, where: Path) -> dict[str, str]:
    """Give every relay of ``job`` a worker socket in ``where``; cluster -> its path."""
    paths = {c: str(where / f"worker-{c}.sock") for c in job.clusters}
    for c in job.clusters:
        job.cfg[c] = dataclasses.replace(job.cfg[c], worker_socket=paths[c])
    return paths


@contextmanager
def local_clients(job: Job, paths: dict[str, str]) -> Iterator[dict[str, RelayClient]]:
    made = {c: job.client(c, local=paths[c]) for c in job.clusters}
    try:
        yield made
    finally:
        for cl in made.values():
            cl.close()


def hello(sock: local.LocalSocket, cluster: str, job_id: str) -> Frame:
    sock.sendall(b"".join(encode_frame(Frame(FrameType.HELLO, {
        "role": "worker", "cluster": cluster, "job_id": job_id}))))
    return recv_frame(sock)


def test_workers_on_the_relays_host_use_its_socket_and_get_the_same_bits(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # beyond sun_path's 108 bytes: bound via its dir
    deep.mkdir(parents=True)
    job = Job(tmp_path, ["a", "b"])
    paths = with_sockets(job, deep)
    assert all(len(p) > local.SHORT_PATH for p in paths.values())
    caplog.set_level(logging.INFO, logger="nebula.relay")
    with running(job), local_clients(job, paths) as cls:
        for p in paths.values():
            mode = os.stat(p).st_mode
            assert stat.S_ISSOCK(mode) and mode & 0o777 == 0o600
        for r in range(3):
            xs = {c: torch.randn(5000) for c in job.clusters}
            res = together(cls, r, xs)
            for c in job.clusters:
                assert torch.equal(res[c].tensor, exact_mean(xs)), (r, c)
                assert res[c].present == ["a", "b"]
        assert {c: cl.transport for c, cl in cls.items()} == {"a": "local", "b": "local"}
        # theta and the outer momentum through shared memory, both ways
        theta, momentum = torch.randn(5000), torch.randn(5000)
        cls["a"].publish_state(2, theta, momentum)
        got_round, got = cls["a"].fetch_state_with_round()
        assert got_round == 2 and got is not None and torch.equal(got, theta)
        # the result is the worker's own memory: writing to it changes nothing at the relay
        again = together(cls, 2, xs)["a"].tensor
        again.add_(1.0)
        assert torch.equal(together(cls, 2, xs)["a"].tensor, exact_mean(xs))
    assert caplog.text.count("connected through the local socket") >= 2
    for p in paths.values():
        assert not os.path.exists(p)  # removed when the relay stops


def test_a_local_worker_and_a_tls_worker_average_alike(tmp_path: Path) -> None:
    """Cluster a's rank 0 shares its relay's host, cluster b's is on another host (TLS):
    the same averages, bit for bit, as when both use TLS."""
    job = Job(tmp_path, ["a", "b"])
    paths = with_sockets(job, tmp_path)
    xs = [{c: torch.randn(3000) for c in job.clusters} for _ in range(2)]
    with running(job):
        mixed = {"a": job.client("a", local=paths["a"]), "b": job.client("b")}
        try:
            got = [together(mixed, r, x) for r, x in enumerate(xs)]
            assert (mixed["a"].transport, mixed["b"].transport) == ("local", "tls")
        finally:
            for cl in mixed.values():
                cl.close()
    tls_job = Job(tmp_path / "tls", ["a", "b"], job_id="job-tls")
    with running(tls_job):
        plain = {c: tls_job.client(c) for c in tls_job.clusters}
        try:
            want = [together(plain, r, x) for r, x in enumerate(xs)]
            assert {cl.transport for cl in plain.values()} == {"tls"}
        finally:
            for cl in plain.values():
                cl.close()
    for g, w in zip(got, want, strict=True):
        for c in job.clusters:
            assert torch.equal(g[c].tensor, w[c].tensor)


def test_what_the_client_lends_crosses_to_the_relay_without_a_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contribution written in the client's ``contribution_buffer`` and a state published
    from the two halves of one ``state_buffer`` reach the relay in the memory they were written
    in: no memfd is made to copy them into ("nebula-tensor"), where plain tensors get one each;
    the averages and the published state are the same bits either way, and the contribution's
    memory is used again the next round."""
    job = Job(tmp_path, ["a", "b"])
    paths = with_sockets(job, tmp_path)
    copies: list[str] = []
    made = os.memfd_create

    def counting(name: str, flags: int = 0) -> int:
        if name == "nebula-tensor":
            copies.append(name)
        return made(name, flags)

    monkeypatch.setattr(os, "memfd_create", counting)
    n = 5000
    with running(job), local_clients(job, paths) as cls:
        lent: dict[str, torch.Tensor] = {}
        ptrs = []
        for r in range(3):
            xs = {c: torch.randn(n) for c in job.clusters}
            for c in job.clusters:
                lent[c] = cls[c].contribution_buffer(n)
                lent[c].copy_(xs[c])
            res = together(cls, r, lent)
            for c in job.clusters:
                assert torch.equal(res[c].tensor, exact_mean(xs)), (r, c)
            ptrs.append(lent["a"].data_ptr())
        assert len(set(ptrs)) == 1  # the staging memory, used again every round
        theta, momentum = torch.randn(n), torch.randn(n)
        joined = cls["a"].state_buffer(2 * n)
        joined[:n].copy_(theta)
        joined[n:].copy_(momentum)
        cls["a"].publish_state(3, joined[:n], joined[n:])
        assert copies == []  # nothing copied on its way
        got_round, got = cls["a"].fetch_state_with_round()
        assert got_round == 3 and got is not None and torch.equal(got, theta)
        copies.clear()  # (the relay's answer to a fetch is a copy of its own)
        cls["a"].publish_state(4, theta, momentum)  # two tensors of their own: joined, copied
        assert len(copies) == 1
        got_round, got = cls["a"].fetch_state_with_round()
        assert got_round == 4 and got is not None and torch.equal(got, theta)


def test_a_socket_that_is_not_there_means_tls(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a"])  # this relay has no socket: the plan's path is missing
    with running(job):
        cl = job.client("a", local=str(tmp_path / "gone.sock"))
        try:
            out = cl.allreduce(0, torch.arange(10, dtype=torch.float32))
            assert cl.transport == "tls" and torch.equal(out.tensor, torch.arange(10.0))
        finally:
            cl.close()


def _memfd(data: bytes, seals: int) -> int:
    import fcntl

    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_contribution_sealed_against_resizing_only_is_taken(tmp_path: Path) -> None:
    """A worker's staging memory (written again between rounds) is sealed against resizing
    only: the relay takes it, and the worker's next round in the same memory is read anew."""
    import fcntl

    job = Job(tmp_path, ["a"])
    paths = with_sockets(job, tmp_path)
    with running(job):
        with local_clients(job, paths) as cls:  # fixes the size this relay syncs: 8
            for r in range(3):  # the client's own staging memory, used again
                x = torch.full((8,), float(r))
                assert torch.equal(cls["a"].allreduce(r, x).tensor, x)
            assert cls["a"]._staging is not None and cls["a"]._staging_free
        conn = local.connect(paths["a"], 5.0)
        try:
            assert hello(conn, "a", job.cfg["a"].job_id).type == FrameType.WELCOME
            fd = _memfd(torch.arange(8.0).numpy().tobytes(),
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            try:
                conn.send_with_fd(b"".join(encode_frame(Frame(FrameType.CONTRIB, {
                    "op": "allreduce", "round": 3, "numel": 8}))), fd)
            finally:
                os.close(fd)
            answer = recv_frame(conn)
            assert answer.type == FrameType.RESULT and answer.meta["present"] == ["a"]
            got = recv_tensor(conn, FrameType.RESULT, 8)
            assert torch.equal(got, torch.arange(8.0))
        finally:
            conn.close()


def test_shared_memory_must_be_sealed_sized_and_announced(tmp_path: Path) -> None:
    import fcntl

    job = Job(tmp_path, ["a"])
    paths = with_sockets(job, tmp_path)
    sealed = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    ok = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    cases = {  # what the worker sends -> what the relay answers
        "unsealed": (ok, 0, 8, "not sealed"),
        "growable": (ok, fcntl.F_SEAL_SHRINK, 8, "not sealed"),
        "shrinkable": (ok, fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE, 8, "not sealed"),
        "short": (ok[:16], sealed, 8, "shared memory of 16 bytes"),
        "larger": (ok + ok[:4], sealed, 8, "shared memory of 36 bytes"),
        "beyond the cap": (ok, sealed, 9, "at most 8 elements"),  # checked before the fd
    }
    with running(job) as relays:
        with local_clients(job, paths) as cls:  # fixes the size this relay syncs: 8
            assert torch.equal(cls["a"].allreduce(0, torch.ones(8)).tensor, torch.ones(8))
        for name, (data, seals, numel, reason) in cases.items():
            conn = local.connect(paths["a"], 5.0)
            try:
                assert hello(conn, "a", job.cfg["a"].job_id).type == FrameType.WELCOME
                head = b"".join(encode_frame(Frame(FrameType.CONTRIB, {
                    "op": "allreduce", "round": 1, "numel": numel})))
                fd = _memfd(data, seals)
                try:
                    conn.send_with_fd(head, fd)
                finally:
                    os.close(fd)
                answer = recv_frame(conn)
                assert answer.type == FrameType.ERROR and reason in answer.meta["reason"], name
            finally:
                conn.close()
        # a descriptor with a frame that carries no tensor ends the session
        conn = local.connect(paths["a"], 5.0)
        try:
            fd = _memfd(ok, sealed)
            try:
                conn.send_with_fd(b"".join(encode_frame(Frame(FrameType.HELLO, {
                    "role": "worker", "cluster": "a"}))), fd)
            finally:
                os.close(fd)
            assert recv_frame(conn).type == FrameType.WELCOME
            answer = recv_frame(conn)
            assert answer.type == FrameType.ERROR and "file descriptor" in answer.meta["reason"]
        finally:
            conn.close()
        # a worker of another cluster (a misdirected plan) is refused at HELLO
        conn = local.connect(paths["a"], 5.0)
        try:
            answer = hello(conn, "b", job.cfg["a"].job_id)
            assert answer.type == FrameType.ERROR and "cluster 'b'" in answer.meta["reason"]
        finally:
            conn.close()
        assert relays["a"].refusals.total >= len(cases) + 2
        with local_clients(job, paths) as cls:  # the relay is unharmed
            out = cls["a"].allreduce(1, torch.full((8,), 2.0))
            assert torch.equal(out.tensor, torch.full((8,), 2.0))


def test_memfd_round_trip_is_the_tensor() -> None:
    x = torch.randn(1000)
    fd = local.to_memfd(x)
    y = local.from_memfd(fd, 1000)
    assert torch.equal(x, y)
    with pytest.raises(OSError):
        os.fstat(fd)  # from_memfd closed it: the mapping holds the memory


def _connect_as(uid: int, path: str, first: bytes) -> str:
    """In a forked child that drops to ``uid``: connect to ``path``, send ``first``, and say
    what happened ("refused-by-kernel", "closed" (no answer), or the answer's first bytes)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no locks, no logging, only syscalls
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            try:
                s.connect(path)
            except PermissionError:
                os.write(w, b"refused-by-kernel")
                os._exit(0)
            try:
                s.sendall(first)
                data = s.recv(64)
            except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread
                data = b""
            os.write(w, b"answered" if data else b"closed")
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            os.write(w, f"error {exc!r}".encode())
        os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_a_process_of_another_uid_is_refused(tmp_path: Path) -> None:
    nobody = 65534
    first = b"".join(encode_frame(Frame(FrameType.HELLO, {"role": "worker", "cluster": "a"})))
    where = Path(tempfile.mkdtemp(prefix="nebula-local-"))  # /tmp: the child can reach it
    try:
        job = Job(tmp_path, ["a"])
        paths = with_sockets(job, where)
        relay = Relay(job.cfg["a"])
        relay.start()
        try:
            # as the plan makes it: the socket is its owner's only (0600, in a 0700 dir)
            assert _connect_as(nobody, paths["a"], first) == "refused-by-kernel"
            # opened up by mistake: the kernel lets it connect, the relay checks the uid
            os.chmod(where, 0o711)
            os.chmod(paths["a"], 0o666)
            before = relay.refusals.total
            assert _connect_as(nobody, paths["a"], first) == "closed"
            assert relay.refusals.total == before + 1
            assert any(f"uid {nobody}" in who for _, who in relay.refusals.counts)
            # and its own user still gets in
            cl = job.client("a", local=paths["a"])
            try:
                assert cl.allreduce(0, torch.ones(4)).present == ["a"]
                assert cl.transport == "local"
            finally:
                cl.close()
        finally:
            relay.stop()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_file_in_the_sockets_place_is_not_removed(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    job = Job(tmp_path, ["a"])
    paths = with_sockets(job, tmp_path)
    Path(paths["a"]).write_text("not a socket")
    with running(job) as relays:
        assert relays["a"].local_socket is None
        assert "is not a socket" in caplog.text
        cl = job.client("a", local=paths["a"])
        try:
            cl.allreduce(0, torch.ones(4))
            assert cl.transport == "tls"  # the worker still reaches its relay
        finally:
            cl.close()
    assert Path(paths["a"]).read_text() == "not a socket"


def test_a_relay_refused_worker_hears_why(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a"])
    paths = with_sockets(job, tmp_path)
    with running(job):
        cl = job.client("a", local=paths["a"], retry_for=1.0)
        try:
            cl.allreduce(0, torch.ones(4))
            with pytest.raises(RelayError, match="4 elements"):
                cl.allreduce(1, torch.ones(5))
        finally:
            cl.close()
        conn = local.connect(paths["a"], 5.0)
        try:
            assert hello(conn, "a", job.cfg["a"].job_id).type == FrameType.WELCOME
            send_tensor(conn, FrameType.STATE, {"op": "publish", "round": 0, "parts": 3},
                        torch.ones(12))
            answer = recv_frame(conn)
            assert answer.type == FrameType.ERROR and "3 parts" in answer.meta["reason"]
            with pytest.raises(ConnectionClosed):  # the session is over
                recv_frame(conn)
        finally:
            conn.close()


def test_a_worker_refused_at_its_requests_head_reads_why_though_it_still_sends(
        tmp_path: Path) -> None:
    """The relay refuses a contribution of the wrong size at its head frame, with the rest of
    it in flight. Closed at once, its socket was reset and the worker's next send failed
    ("EOF occurred in violation of protocol") before it read the refusal (CI, 2026-12-03)."""
    job = Job(tmp_path, ["a"])
    with running(job) as relays:
        cl = job.client("a", retry_for=1.0)
        try:
            cl.allreduce(0, torch.ones(4))  # the relay syncs 4 elements from now on
            sock = cl._connect()
            frames = tensor_frames(FrameType.CONTRIB, encode(Contrib(round=1, numel=11)),
                                   torch.zeros(11))
            head = b"".join(encode_frame(frames[0]))
            rest = b"".join(b"".join(bytes(p) for p in encode_frame(f)) for f in frames[1:])
            refused = relays["a"].refusals.total
            sock.sendall(head)
            sock.sendall(rest[:8])  # a TLS record of its own: the relay reads only the head
            deadline = time.monotonic() + 10
            while relays["a"].refusals.total == refused and time.monotonic() < deadline:
                time.sleep(0.02)
            assert relays["a"].refusals.total == refused + 1
            time.sleep(0.3)  # the relay has sent its refusal and ended its side
            sock.sendall(rest[8:])
            answer = recv_frame(sock)
            assert answer.type == FrameType.ERROR
            assert "this relay syncs 4 elements" in answer.meta["reason"]
            with pytest.raises(ConnectionClosed):
                recv_frame(sock)
        finally:
            cl.close()


def test_a_refused_contribution_too_long_to_read_away_still_says_why(tmp_path: Path) -> None:
    """Beyond what the relay reads away (LINGER_BYTES) it resets the connection: the client's
    send fails, and the client reads the refusal that waits behind it, not retrying."""
    job = Job(tmp_path, ["a"])
    with running(job):
        cl = job.client("a", retry_for=1.0)
        try:
            cl.allreduce(0, torch.ones(4))
            big = torch.zeros(2 * LINGER_BYTES // 4)
            with pytest.raises(RelayError, match="relay refused: .*this relay syncs 4 elements"):
                cl.allreduce(1, big)
            assert torch.equal(cl.allreduce(1, torch.full((4,), 2.0)).tensor,
                               torch.full((4,), 2.0))
        finally:
            cl.close()


def test_the_relay_builds_averages_in_memory_it_used_before_but_never_in_one_still_held(
        tmp_path: Path) -> None:
    """Results a worker dropped are told to the relay, which builds later averages in their
    memory (no new pages each round); results the worker still holds keep their values however
    many rounds follow, and so do the relay's own last rounds."""
    job = Job(tmp_path, ["a", "b"], chunk_numel=1 << 14)
    paths = with_sockets(job, tmp_path)
    with running(job) as relays, local_clients(job, paths) as cls:
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a's result, its expected value)
        for r in range(8):
            xs = {c: torch.randn(100_000) for c in job.clusters}
            res = together(cls, r, xs)
            want = exact_mean(xs)
            for c in job.clusters:
                assert torch.equal(res[c].tensor, want), (r, c)
            if r % 3 == 0:  # the worker keeps some results, drops the others
                kept.append((res["a"].tensor, want))
            del res
            for got, expected in kept:
                assert torch.equal(got, expected)
        pools = {c: relays[c].workers.shared for c in job.clusters}
        assert all(p is not None and p.reused >= 3 for p in pools.values()), pools
        assert all(p is not None and len(p._entries) <= local.MAX_POOLED_RESULTS
                   for p in pools.values())


def test_buffer_pools_hand_out_only_what_nothing_else_holds() -> None:
    from nebula_cli.relay.net.buffers import BufferPool

    pool = BufferPool(max_buffers=2, min_bytes=16)
    first = pool.get(100)
    assert pool.get(100) is not first  # still held
    view = torch.frombuffer(memoryview(first), dtype=torch.uint8)
    ident = id(first)
    del first
    assert id(pool.get(100)) != ident  # a tensor still reads it
    del view
    again = pool.get(100)
    assert id(again) == ident and pool.reused == 2  # the second buffer, then the first
    assert len(pool.get(8)) == 8 and pool.held_bytes == 200  # small ones are not pooled
    del again
    other = pool.get(300)  # full: a free buffer of another size makes room
    assert len(other) == 300 and pool.held_bytes == 400


def test_an_average_lent_twice_is_used_again_only_once_both_are_released() -> None:
    """A retried round hands the same average to the worker twice: each time gets its own
    token, and its memory is built in again only once both came back; a token of another pool
    (a relay before a restart) frees nothing; what a session did not release is dropped."""
    pool = local.SharedPool(cap=3)
    avg = pool.empty(1000)
    ptr = avg.data_ptr()
    first, second = pool.lend(avg), pool.lend(avg)
    assert first is not None and second is not None and first != second
    del avg
    other = local.SharedPool(cap=3)
    other.empty(1000)
    pool.release([first])
    assert pool.empty(1000).data_ptr() != ptr  # still mapped by the second result
    other.release([second])  # another pool's release: nothing changes here
    assert pool.empty(1000).data_ptr() != ptr
    pool.release([second])
    again = pool.empty(1000)
    assert again.data_ptr() == ptr and pool.reused >= 1
    token = pool.lend(again)
    assert token is not None
    del again
    pool.forget([token])  # the session ended without releasing it: never used again
    assert all(e.ptr != ptr for e in pool._entries)
