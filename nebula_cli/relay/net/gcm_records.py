"""The relays' data plane after their mutual-TLS handshake: AES-256-GCM records on the same
TCP connection, with keys derived from both relays' shares and the TLS session.

Why. Python's TLS moves a 16 KiB record per call: a relay exchanging a 256 MB round spends
most of its CPU in per-record work (a system call or two, the GIL handed back and forth, the
kernel's acknowledgements) rather than in the cipher (docs/benchmarks.md). Records of up to
:data:`MAX_RECORD` bytes, encrypted and decrypted by ``cryptography``'s AES-GCM in one call each
(the GIL released), cost a few calls per chunk instead of hundreds.

How, step by step (:mod:`nebula_cli.relay.net.peers` drives it):

1. The relays connect and authenticate each other exactly as before: TLS 1.3, certificates of
   the job's CA, HELLO and WELCOME checked.
2. Inside that TLS session the HELLO carries the dialer's share and the WELCOME the
   acceptor's (:func:`offer`; 32 random bytes each, new for every connection).
3. Both read the session's channel binding (``tls-unique``: the client's Finished message,
   which covers the whole handshake, certificates included), close TLS cleanly (close_notify
   both ways, :func:`unwrap`) and go on on the same TCP connection with :class:`RecordConn`.
   A relay that does not offer a share keeps TLS.

Keys, as TLS 1.3 makes them (RFC 8446 section 7): each direction has a traffic secret,
``HKDF(salt = the channel binding, ikm = sender's share || receiver's share, info = "...
traffic")``; its AES-256 key and its 12-byte IV are expanded from that secret. Both relays
contribute, and the keys belong to this one TLS session: shares replayed into another session
give other keys. The nonce is the record's number in its direction XOR the IV (never sent). A
record replayed, reordered, dropped, cut or altered fails to authenticate, and the link closes
as on any protocol error. After :data:`REKEY_BYTES` under one key (both ends count the same
bytes) the next secret is expanded from the current secret (never from the key in use), far
below AES-GCM's limits (TLS 1.3 allows about 2^38 bytes per key). A receiver refuses a length
above :data:`MAX_RECORD` before it reads or allocates anything.

One thread writes and one thread reads a connection (the link's sender and receiver): each
direction is guarded by a lock taken without waiting, so a second writer (or reader) fails with
:class:`RecordError` instead of reusing a nonce or interleaving records.

Why not an exporter (RFC 5705 / 8446 ``exporter_master_secret``): Python's ``ssl`` (3.11
here) has none; pyOpenSSL's ``export_keying_material`` would mean running the relays' TLS on
pyOpenSSL instead of ``ssl``. The channel binding Python gives under TLS 1.3 is the client's
Finished (RFC 9266 prefers the exporter for new protocols); it is used only to bind the keys to
the session, as HKDF's salt; their secrecy comes from the shares, sent inside that same
authenticated TLS session.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from nebula_cli.relay.net.wire import ConnectionClosed, WireError

CIPHER = "aes-256-gcm/hkdf-tls-unique"
"""What a relay offers in its HELLO / WELCOME (the only record scheme there is; a relay that
offers another keeps TLS with this one)."""
KEY_BYTES = 32
"""Bytes of a share, of a traffic secret and of an AES-256 key."""
IV_BYTES = 12
TAG_BYTES = 16
MAX_RECORD = 16 << 20
"""Largest plaintext in one record: a chunk of the default size (4 MiB of fp32) is one record."""
REKEY_BYTES = 1 << 36
"""Plaintext bytes one key protects (64 GiB) before the next key is derived from it."""
_LEN = struct.Struct(">I")
_INTO = hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")
"""cryptography >= 47 encrypts and decrypts into a given buffer; older versions return new
bytes (one more copy a record, same records on the wire)."""
_LABEL = b"nebula relay records v2 "
BINDING = "tls-unique"


class RecordError(WireError):
    """A record that does not authenticate, or is larger than a record may be."""


def offer() -> tuple[bytes, dict[str, str]]:
    """A new share of this relay's, and the meta that offers it to the peer."""
    share = os.urandom(KEY_BYTES)
    return share, {"cipher": CIPHER, "key": share.hex()}


def accepted(meta: Any) -> bytes | None:
    """The peer's share from the ``records`` meta of its HELLO / WELCOME (None: it keeps
    TLS)."""
    if not isinstance(meta, dict) or meta.get("cipher") != CIPHER:
        return None
    try:
        key = bytes.fromhex(str(meta.get("key", "")))
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def describe(meta: Any) -> str:
    """An offer as a log line may show it: its cipher, never its key."""
    cipher = meta.get("cipher") if isinstance(meta, dict) else None
    return f"cipher {cipher!r}" if cipher is not None else f"an offer of type {type(meta).__name__}"


def _expand(secret: bytes, what: bytes, length: int) -> bytes:
    return HKDFExpand(SHA256(), length, _LABEL + what).derive(secret)


def traffic_secret(sender: bytes, receiver: bytes, binding: bytes) -> bytes:
    """The first traffic secret of the direction from the relay that offered `sender` to the
    one that offered `receiver`, in the TLS session whose channel binding is `binding`."""
    return HKDF(SHA256(), KEY_BYTES, salt=binding, info=_LABEL + b"traffic").derive(
        sender + receiver)


class _Direction:
    """One direction's traffic secret, key, IV, record number and bytes under the key."""

    def __init__(self, secret: bytes) -> None:
        self._use(secret)

    def _use(self, secret: bytes) -> None:
        self.secret = secret
        self.key = _expand(secret, b"key", KEY_BYTES)
        self.iv = int.from_bytes(_expand(secret, b"iv", IV_BYTES), "big")
        self.aead, self.seq, self.bytes = AESGCM(self.key), 0, 0

    def nonce(self, nbytes: int) -> bytes:
        """The next record's nonce (its number XOR the IV), counting its ``nbytes``; the key
        is updated after the record that reaches REKEY_BYTES."""
        nonce = (self.seq ^ self.iv).to_bytes(IV_BYTES, "big")
        self.seq += 1
        self.bytes += nbytes
        return nonce

    def after(self) -> None:
        if self.bytes >= REKEY_BYTES:
            self._use(_expand(self.secret, b"traffic upd", KEY_BYTES))


@dataclass(frozen=True)
class Unwrapped:
    """A connection whose TLS was closed (:func:`unwrap`): the TCP socket under it and the
    TLS session's channel binding, read before."""

    sock: socket.socket
    binding: bytes


class RecordConn:
    """``sendall`` and ``recv_into`` over AES-GCM records for one writer thread and one
    reader thread (each direction has its own secret, key and state, and a lock that a second
    thread finds taken: RecordError). Built from the connection :func:`unwrap` returned (or a
    socket and the `binding` of the TLS session the shares were exchanged in), this relay's
    share (`send_share`) and the peer's."""

    def __init__(self, sock: socket.socket | Unwrapped, send_share: bytes, recv_share: bytes,
                 *, binding: bytes | None = None) -> None:
        if isinstance(sock, Unwrapped):
            sock, binding = sock.sock, sock.binding
        if send_share == recv_share:
            raise RecordError("the peer offered this relay's own share: the two directions "
                              "need different keys")
        if not binding:
            raise RecordError("AES-GCM records need the TLS session's channel binding")
        self.sock = sock
        self.on_recv: Callable[[], None] | None = None
        """Called after every read from the socket: a large record on a slow link shows
        traffic before it has all arrived (and been authenticated; a dead link whose bytes
        someone forges still fails its round at the stall time-out)."""
        self._tx = _Direction(traffic_secret(send_share, recv_share, binding))
        self._rx = _Direction(traffic_secret(recv_share, send_share, binding))
        self._tx_lock, self._rx_lock = threading.Lock(), threading.Lock()
        self._out = bytearray(0)  # length + ciphertext + tag of the record being sent
        self._in = bytearray(0)  # ciphertext + tag of the record being read
        self._plain = bytearray(0)  # a record's plaintext when the reader asked for less
        self._left = memoryview(b"")  # what is left of it

    # ------------------------------------------------------------------ sending

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        with _Alone(self._tx_lock, "write"):
            for lo in range(0, len(view), MAX_RECORD):  # nothing to send: no record
                self._send_record(view[lo : lo + MAX_RECORD])

    def _send_record(self, piece: memoryview) -> None:
        n = len(piece)
        need = _LEN.size + n + TAG_BYTES
        if len(self._out) < need:
            self._out = bytearray(need)
        out = memoryview(self._out)
        head = _LEN.pack(n)
        out[: _LEN.size] = head
        if _INTO:
            self._tx.aead.encrypt_into(self._tx.nonce(n), piece, head, out[_LEN.size : need])
        else:
            out[_LEN.size : need] = self._tx.aead.encrypt(self._tx.nonce(n), bytes(piece), head)
        self._tx.after()
        self.sock.sendall(out[:need])

    # ------------------------------------------------------------------ receiving

    def recv_into(self, buf: Any, nbytes: int = 0) -> int:
        """Plaintext into ``buf`` (at most ``nbytes``; 0: its length): what is left of the last
        record, else the next record (decrypted straight into ``buf`` when it fits). 0 at the
        end of the stream between records."""
        dest = memoryview(buf).cast("B")
        want = nbytes or len(dest)
        with _Alone(self._rx_lock, "read"):
            while not self._left:
                n = self._read_record(dest, want)
                if n is None:
                    return 0
                if n > 0:
                    return n
            k = min(want, len(self._left))
            dest[:k] = self._left[:k]
            self._left = self._left[k:]
            return k

    def _read_record(self, dest: memoryview, want: int) -> int | None:
        """Read one record: its length when it went straight into ``dest``, 0 when it was kept
        in ``_left`` (larger than ``want``; or empty), None at the end of the stream."""
        head = bytearray(_LEN.size)
        if not self._fill(memoryview(head), start=True):
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_RECORD:
            raise RecordError(f"a record of {n} bytes (at most {MAX_RECORD})")
        if len(self._in) < n + TAG_BYTES:
            self._in = bytearray(n + TAG_BYTES)
        sealed = memoryview(self._in)[: n + TAG_BYTES]
        self._fill(sealed, start=False)
        nonce = self._rx.nonce(n)
        if n <= want:
            self._open(nonce, sealed, head, dest[:n])
            return n
        if len(self._plain) < n:
            self._plain = bytearray(n)
        plain = memoryview(self._plain)[:n]
        self._open(nonce, sealed, head, plain)
        self._left = plain
        return 0

    def _open(self, nonce: bytes, sealed: memoryview, head: bytes | bytearray,
              out: memoryview) -> None:
        try:
            if _INTO:
                self._rx.aead.decrypt_into(nonce, sealed, bytes(head), out)
            else:
                out[:] = self._rx.aead.decrypt(nonce, bytes(sealed), bytes(head))
        except InvalidTag:
            raise RecordError("a record failed authentication (altered, replayed or out of "
                              "order): closing the link") from None
        self._rx.after()

    def _fill(self, view: memoryview, *, start: bool) -> bool:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if self.on_recv is not None:
                self.on_recv()
            if not k:
                if start and got == 0:
                    return False
                raise ConnectionClosed(f"connection closed inside a record ({got} of "
                                       f"{len(view)} bytes)")
            got += k
        return True

    # ------------------------------------------------------------------ the socket

    def fileno(self) -> int:
        return self.sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()


class _Alone:
    """Hold `lock` for one direction's call; a second thread there is a bug: RecordError (two
    writers would reuse nonces and interleave records)."""

    def __init__(self, lock: threading.Lock, what: str) -> None:
        self.lock, self.what = lock, what

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            raise RecordError(f"two threads {self.what} one AES-GCM record stream at once "
                              "(one writer and one reader per connection)")

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def unwrap(tls: Any) -> Unwrapped:
    """Read the TLS session's channel binding, end TLS on ``tls`` (close_notify both ways) and
    return the plain TCP socket under it with the binding."""
    binding = tls.get_channel_binding(BINDING)
    if not binding:
        raise RecordError(f"this Python's ssl gives no {BINDING} channel binding")
    plain = tls.unwrap()
    family, kind, proto = plain.family, plain.type, plain.proto
    sock = socket.socket(family, kind, proto, fileno=plain.detach())
    sock.settimeout(None)  # the link's threads block; closing the link shuts the socket down
    return Unwrapped(sock, bytes(binding))
