"""The worker hop on the relay's own host: a Unix socket in the relay's private directory, and
tensors handed over in sealed shared memory instead of being copied through a socket.

Who may connect. The socket file (``RelayConfig.worker_socket``, mode 0600) lies in the job's
directory on the host (mode 0700), and the relay reads the connecting process's uid from the
kernel (SO_PEERCRED) and refuses any other uid than its own before it reads a byte; a worker
checks the same of the relay before it sends one (a socket planted there gets nothing: the
worker uses TLS instead). On one host that is what mutual TLS proves across hosts (a process of
the job's user, see :meth:`nebula_cli.relay.process.worker_port.WorkerPort.local_handshake`),
without encrypting what never leaves the host's memory. Workers on another host keep mutual
TLS on the worker port.

Tensors. Frames are those of the TLS hop (:mod:`nebula_cli.relay.net.wire`); a tensor's header
frame carries one file descriptor (SCM_RIGHTS) instead of being followed by chunk frames: a
memfd of exactly ``4 * numel`` bytes (fp32), sealed against shrinking and growing (F_SEAL_SHRINK,
F_SEAL_GROW, F_SEAL_SEAL). The receiver checks the declared size against its cap first, then
the memfd's size and seals, and maps it copy-on-write: the sender cannot make the receiver's
mapping fault by truncating it, and the receiver's own writes stay its own.

Both ways the memory is used again rather than new each round (new memory costs a page fault
and a zeroed page per 4 KiB; docs/benchmarks.md). The worker copies its contribution into its
staging memfd (one warm copy) and writes there again only once the relay answered the round
that read it: the relay sees the same bytes from its check to the last chunk it sends (every
relay averages the same bits) because the worker's client keeps to that order, not because of a
write seal (a process of the relay's own uid is trusted with its contribution anyway). The
relay averages straight into memory of a memfd (:class:`SharedPool`) and hands that over without
a copy; the worker reads in place and tells the relay when it no longer maps it. A memfd has no
name: nothing is left in /dev/shm when a process dies.

Linux only (memfd, SO_PEERCRED, SCM_RIGHTS); elsewhere :func:`supported` is False and workers
use the TLS port.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import socket
import ssl
import stat
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nebula_cli.errors import NebulaError
from nebula_cli.relay.net.buffers import POOLING
from nebula_cli.relay.net.wire import WireError

MAX_FDS = 2
"""File descriptors read with one message; more (or a second one pending) end the session."""
FIXED_SIZE = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
"""Seals every memfd has before it is sent: its size cannot change under a mapping."""
FROZEN = FIXED_SIZE | getattr(fcntl, "F_SEAL_WRITE", 0)
"""Seals of a worker's memfd: its bytes cannot change either."""
SHORT_PATH = 100
"""Socket paths longer than this (sun_path holds 108 bytes) are bound and dialled through
/proc/self/fd/N of their directory."""
_WRITE_PIECE = 1 << 30  # os.write moves at most ~2 GiB per call on Linux
MAX_POOLED_RESULTS = 4
"""Averages' memfds a relay keeps to use again (:class:`SharedPool`): the two rounds it holds,
the one its worker maps, and one free."""


class LocalError(NebulaError):
    """The local socket cannot be bound."""


class SharedMemoryError(WireError):
    """A descriptor sent for a tensor is not a sealed memfd of the declared size (or none came,
    or more than one did)."""


def supported() -> bool:
    """Unix sockets with SO_PEERCRED, SCM_RIGHTS and sealed memfds (Linux)."""
    return (sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")
            and hasattr(socket, "SO_PEERCRED") and hasattr(os, "memfd_create")
            and hasattr(fcntl, "F_ADD_SEALS"))


# ---------------------------------------------------------------------- the socket


class _ShortPath:
    """A path usable with bind/connect: itself, or /proc/self/fd/N/<name> of its directory
    opened O_PATH (held open until ``close``)."""

    def __init__(self, path: str) -> None:
        self.dirfd: int | None = None
        self.path = path
        if len(os.fsencode(path)) > SHORT_PATH:
            head, name = os.path.split(path)
            self.dirfd = os.open(head or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self.path = f"/proc/self/fd/{self.dirfd}/{name}"

    def close(self) -> None:
        if self.dirfd is not None:
            os.close(self.dirfd)
            self.dirfd = None

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.close()


def listen(path: str, backlog: int = 16) -> socket.socket:
    """A listening Unix socket at ``path`` (mode 0600). A socket file left there by a relay
    that died is replaced; any other file is refused (LocalError)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise LocalError(f"{path} exists and is not a socket: remove it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _ShortPath(path) as where:
            sock.bind(where)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise LocalError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
    return sock


def connect(path: str, timeout: float) -> LocalSocket:
    """A connection to the relay's socket at ``path`` (OSError when it is not there;
    PermissionError, before a byte is sent, when the process serving it is another user's)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with _ShortPath(path) as where:
            sock.connect(where)
        if (uid := peer_uid(sock)) != os.getuid():
            raise PermissionError(errno.EPERM, f"served by uid {uid}, not by this user's relay")
    except BaseException:
        sock.close()
        raise
    return LocalSocket(sock)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (from the kernel)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class LocalSocket:
    """A connected Unix socket that carries frames and file descriptors: ``recv_into`` and
    ``sendall`` as a socket's (what :mod:`nebula_cli.relay.net.wire` uses), ``send_with_fd`` to
    attach one descriptor to a message, ``take_fd`` to claim the one that arrived. ``seals``:
    what a memfd from the other end must be sealed against (at least :data:`FIXED_SIZE`)."""

    def __init__(self, sock: socket.socket, seals: int = FIXED_SIZE) -> None:
        self.sock = sock
        self.seals = seals
        self.lent: set[int] = set()
        """Tokens of the results the relay lent this worker and it has not released."""
        self._fds: list[int] = []
        self._space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        view = memoryview(buf).cast("B")
        if nbytes:
            view = view[:nbytes]
        n, ancdata, flags, _ = self.sock.recvmsg_into([view], self._space)
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                ints = array.array("i")
                ints.frombytes(data[: len(data) - len(data) % ints.itemsize])
                fds.extend(ints)
        if fds or flags & socket.MSG_CTRUNC:
            self._fds.extend(fds)
            if flags & socket.MSG_CTRUNC or len(self._fds) > 1:
                self.drop_fds()
                raise SharedMemoryError("more than one file descriptor arrived with a message")
        return n

    def sendall(self, data: Any) -> None:
        self.sock.sendall(data)

    def send_with_fd(self, data: bytes, fd: int) -> None:
        """``data`` (a whole frame without payload) with ``fd`` attached to its first byte."""
        fds = array.array("i", [fd])
        sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        if sent < len(data):
            self.sock.sendall(memoryview(data)[sent:])

    def take_fd(self) -> int:
        """The descriptor that arrived with the last frame (SharedMemoryError if none did)."""
        if not self._fds:
            raise SharedMemoryError("a tensor header arrived without its shared memory")
        return self._fds.pop()

    @property
    def pending_fds(self) -> int:
        return len(self._fds)

    def drop_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.sock.gettimeout()

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.drop_fds()
        self.sock.close()


# ---------------------------------------------------------------------- shared memory


_shared: dict[int, tuple[int, int]] = {}  # data_ptr -> (memfd, bytes) of shared_empty's tensors
_shared_lock = threading.Lock()


def shared_empty(numel: int) -> torch.Tensor:
    """A new fp32 tensor of ``numel`` elements in the memory of a memfd sealed against resizing:
    :func:`to_memfd` hands that memfd over without a copy. The memfd is closed when the last
    tensor over that memory is gone."""
    if not numel:
        return torch.empty(0)
    return torch.frombuffer(_shared_map(numel), dtype=torch.float32)  # keeps the mapping alive


def _shared_map(numel: int) -> mmap.mmap:
    """The shared mapping of a new memfd of ``numel`` fp32 elements, registered for
    :func:`to_memfd` until the mapping is gone."""
    fd = os.memfd_create("nebula-result", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4 * numel)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FIXED_SIZE | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, 4 * numel, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    ptr = _address(mm)
    with _shared_lock:
        _shared[ptr] = (fd, 4 * numel)
    weakref.finalize(mm, _unshare, ptr, fd)  # runs before the unmap
    return mm


def _address(mm: mmap.mmap) -> int:
    return torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()


@dataclass
class _Pooled:
    mm: mmap.mmap
    numel: int
    ptr: int
    lent: set[int] = field(default_factory=set)
    """Tokens of the times it went to a worker and was not released yet."""


class SharedPool:
    """Memory for the rounds' averages (:func:`shared_empty`'s memfds) used again once nobody
    holds it: a new memfd costs a page fault and a zeroed page per 4 KiB each round, on a
    virtual machine that returns freed memory to its host far more (docs/benchmarks.md).

    A relay's own holders (its last rounds, the exchange) are seen from the mapping's reference
    count; its worker's are not, so each time an average is handed to a worker it is *lent*
    (:meth:`lend` gives a new random token that goes with it) until the worker says it dropped
    that result (:meth:`release`; its next request carries the tokens of the results it no
    longer maps). A token of another session or an earlier relay matches nothing; what a
    session was lent and did not release when it ended is never used again (:meth:`forget`).
    At most ``cap`` memfds are kept: beyond that the oldest is forgotten (it lives as long as
    whoever maps it). Without a reliable reference count (:data:`~nebula_cli.relay.net.buffers.
    POOLING`) every average gets a new memfd."""

    def __init__(self, cap: int = MAX_POOLED_RESULTS) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._entries: list[_Pooled] = []  # oldest first
        self.reused = 0
        """Averages built in memory used before (for tests and the benchmark)."""

    def empty(self, numel: int) -> torch.Tensor:
        """An fp32 tensor of ``numel`` elements in a free memfd of that size, else a new one."""
        if not numel:
            return torch.empty(0)
        if not POOLING:
            return shared_empty(numel)
        with self._lock:
            for entry in self._entries:
                # referenced by the entry and getrefcount's argument only: no tensor maps it
                if entry.numel == numel and not entry.lent and sys.getrefcount(entry.mm) == 2:
                    self.reused += 1
                    return torch.frombuffer(entry.mm, dtype=torch.float32)
            if len(self._entries) >= self.cap:
                del self._entries[0]
            mm = _shared_map(numel)
            self._entries.append(_Pooled(mm, numel, _address(mm)))
            return torch.frombuffer(mm, dtype=torch.float32)

    def lend(self, tensor: torch.Tensor) -> int | None:
        """``tensor`` (a whole average of this pool) goes to a worker: a new token for this
        time, else None (not pooled memory)."""
        with self._lock:
            for entry in self._entries:
                if entry.ptr == tensor.data_ptr() and entry.numel == tensor.numel():
                    token = secrets.randbits(62)
                    entry.lent.add(token)
                    return token
        return None

    def release(self, tokens: Iterable[Any]) -> None:
        """The worker no longer maps the results these tokens came with (others are ignored)."""
        wanted = {t for t in tokens if isinstance(t, int)}
        with self._lock:
            for entry in self._entries:
                entry.lent -= wanted

    def forget(self, tokens: Iterable[int]) -> None:
        """A worker's connection ended without releasing these: their memory is left to it,
        never used again here."""
        gone = set(tokens)
        with self._lock:
            self._entries = [e for e in self._entries if not e.lent & gone]


def _unshare(ptr: int, fd: int) -> None:
    with _shared_lock:
        _shared.pop(ptr, None)
    os.close(fd)


def to_memfd(tensor: torch.Tensor) -> int:
    """A memfd holding ``tensor`` (flat, contiguous fp32 CPU) as its bytes, to send and close:
    a duplicate of its own when :func:`shared_empty` made it, else a new one (one copy), sealed
    as :data:`FROZEN` says."""
    with _shared_lock:
        fd, nbytes = _shared.get(tensor.data_ptr(), (-1, -1))
        if nbytes == 4 * tensor.numel():
            return os.dup(fd)
    data = memoryview(tensor.numpy()).cast("B")
    fd = os.memfd_create("nebula-tensor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, data.nbytes)
        off = 0
        while off < data.nbytes:
            off += os.pwrite(fd, data[off : off + _WRITE_PIECE], off)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FROZEN | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def from_memfd(fd: int, numel: int, seals: int = FROZEN,
               on_unmap: Callable[[], None] | None = None) -> torch.Tensor:
    """The fp32 tensor of ``numel`` elements in memfd ``fd`` (mapped copy-on-write; ``fd`` is
    closed). SharedMemoryError unless it is a memfd of exactly that size with ``seals`` set
    (``numel`` is the receiver's checked size: the mapping is never larger). ``on_unmap`` runs
    once no tensor over the mapping is left."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != 4 * numel:
            raise SharedMemoryError(f"shared memory of {st.st_size} bytes for a tensor of {numel} "
                            f"elements ({4 * numel} bytes)")
        try:
            fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise SharedMemoryError("the file descriptor sent for a tensor is not a memfd"
                                    ) from None
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals != seals:
            raise SharedMemoryError("shared memory that is not sealed against " + (
                "writes and resizing" if seals & fcntl.F_SEAL_WRITE else "resizing"))
        mm = mmap.mmap(fd, 4 * numel, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if on_unmap is not None:
        weakref.finalize(mm, on_unmap)
    return torch.frombuffer(mm, dtype=torch.float32)  # keeps the mapping alive


HopSocket = ssl.SSLSocket | LocalSocket
"""A connection of the relay's hop to its cluster's ranks: mutual TLS, or on its own host this
socket."""
