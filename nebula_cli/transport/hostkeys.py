"""known_hosts policy: a host's key must be on record; new keys only with accept-new.

Reads OpenSSH known_hosts files (plain, `[host]:port` and hashed `|1|salt|hash` names,
`*`/`?` patterns, `!` negations, `@revoked` markers; `@cert-authority` lines are skipped:
paramiko's client asks for plain host keys, not host certificates). Keys recorded with
accept-new are hashed when ssh_config says `HashKnownHosts yes`.
A key that differs from the one on record is always refused. An unknown key is refused
unless `accept_new` is set, which records it like OpenSSH's StrictHostKeyChecking=accept-new.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import hmac
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from paramiko import PKey

from nebula_cli.errors import TransportError

SSH_PORT = 22
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"

_file_locks: dict[str, threading.Lock] = {}
_file_locks_guard = threading.Lock()


class HostKeyError(TransportError):
    """The host's key could not be verified against known_hosts."""


class UnknownHostKey(HostKeyError):
    """The host has no key on record (and accept-new is off)."""


class ChangedHostKey(HostKeyError):
    """The host presented a key other than the one on record (or a revoked one)."""


def fingerprint(key: PKey | bytes) -> str:
    """The key's fingerprint as OpenSSH prints it: ``SHA256:<base64 without padding>``."""
    blob = key if isinstance(key, bytes) else key.asbytes()
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode()
    return "SHA256:" + digest.rstrip("=")


def host_entry_name(host: str, port: int) -> str:
    """The name a host is recorded under: ``host`` on port 22, else ``[host]:port``."""
    return host if port == SSH_PORT else f"[{host}]:{port}"


def hashed_name(name: str) -> str:
    """`name` as OpenSSH's HashKnownHosts writes it: ``|1|<salt>|<HMAC-SHA1(salt, name)>``."""
    salt = os.urandom(20)
    mac = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(mac).decode()}"


def _pattern_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("|1|"):
        try:
            _, _, salt, digest = pattern.split("|", 3)
            mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
            return hmac.compare_digest(mac, base64.b64decode(digest))
        except (ValueError, binascii.Error):
            return False
    # OpenSSH patterns know only `*` and `?`; `[` is literal (as in `[host]:port`).
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, re.IGNORECASE | re.DOTALL) is not None


def _names_match(patterns: str, name: str) -> bool:
    """OpenSSH list semantics: any positive pattern matches and no negated one does."""
    matched = False
    for pattern in patterns.split(","):
        if pattern.startswith("!"):
            if _pattern_matches(pattern[1:], name):
                return False
        elif _pattern_matches(pattern, name):
            matched = True
    return matched


@dataclass(frozen=True)
class KnownKey:
    """One key line of a known_hosts file."""

    path: str
    line: int
    marker: str | None  # None, "@revoked" or "@cert-authority"
    patterns: str
    key_type: str
    blob: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.blob)


def parse_known_hosts(path: str) -> Iterator[KnownKey]:
    """Every well-formed key line of a known_hosts file (a missing file has none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise TransportError(f"cannot read known_hosts file {path}: {exc}") from exc
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (ValueError, binascii.Error):
            continue
        yield KnownKey(path, number, marker, fields[0], fields[1], blob)


def _file_lock(path: str) -> threading.Lock:
    with _file_locks_guard:
        return _file_locks.setdefault(os.path.abspath(path), threading.Lock())


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Serialises writers of one known_hosts file across threads and processes."""
    with _file_lock(path):
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDONLY, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class KnownHosts:
    """The known_hosts policy for one file (plus read-only extra files, e.g. the global one)."""

    def __init__(self, path: str, *, accept_new: bool = False,
                 extra_files: Sequence[str] = (), hash_names: bool = False) -> None:
        self.path = os.path.expanduser(path)
        self.accept_new = accept_new
        self.hash_names = hash_names
        """Record new keys under hashed names (ssh_config's HashKnownHosts)."""
        self.extra_files = [os.path.expanduser(p) for p in extra_files]

    def _entries(self, name: str) -> list[KnownKey]:
        found = []
        for path in [self.path, *self.extra_files]:
            found += [k for k in parse_known_hosts(path) if _names_match(k.patterns, name)]
        return found

    def known_types(self, host: str, port: int) -> list[str]:
        """Key types on record for the host, to ask the server for those first."""
        name = host_entry_name(host, port)
        return [k.key_type for k in self._entries(name) if k.marker is None]

    def recorded(self, host: str, port: int) -> list[str]:
        """The keys on record for host:port, as ``type base64`` (revoked and CA lines left
        out), the writable file's first."""
        name = host_entry_name(host, port)
        return [f"{k.key_type} {base64.b64encode(k.blob).decode()}"
                for k in self._entries(name) if k.marker is None]

    def verify(self, host: str, port: int, key: PKey, *, display: str | None = None) -> None:
        """Accept `key` for host:port or raise HostKeyError (see the module docstring)."""
        name = host_entry_name(host, port)
        shown = display or name
        if self._judge(name, shown, key, self._entries(name)):
            return
        if self.accept_new:
            with _locked(self.path):
                # Another thread or process may have recorded a key for this host meanwhile.
                if not self._judge(name, shown, key, self._entries(name)):
                    self._append(name, key)
            return
        port_arg = f"-p {port} " if port != SSH_PORT else ""
        raise UnknownHostKey(
            f"unknown host key for {name}: {key.get_name()} {fingerprint(key)}. To trust it, "
            f"check that fingerprint with the host's administrator, then run "
            f"`ssh-keyscan {port_arg}{host} >> {self.path}`, or pass --accept-new-host-keys "
            f"to record new keys automatically (changed keys are still refused).", host=shown)

    def _judge(self, name: str, shown: str, key: PKey, entries: list[KnownKey]) -> bool:
        """True when the key is on record, False when the host is unknown; raises otherwise."""
        blob, key_type, new_fp = key.asbytes(), key.get_name(), fingerprint(key)
        for entry in entries:
            if entry.marker == "@revoked" and entry.blob == blob:
                raise ChangedHostKey(
                    f"the host key {new_fp} of {name} is marked @revoked in "
                    f"{entry.path}:{entry.line}; refusing to connect", host=shown)
        plain = [k for k in entries if k.marker is None]
        if any(k.blob == blob for k in plain):
            return True
        if not plain:
            return False
        same_type = [k for k in plain if k.key_type == key_type]
        old = same_type or plain
        records = ", ".join(f"{k.key_type} {k.fingerprint} ({k.path}:{k.line})" for k in old)
        what = ("" if same_type else
                f" (the server no longer offers the recorded key type {old[0].key_type})")
        raise ChangedHostKey(
            f"WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED (HOST KEY CHANGED) for {name}"
            f"{what}. Someone could be eavesdropping on you right now (man-in-the-middle), "
            f"or the host key has just been changed. Recorded: {records}. "
            f"Offered now: {key_type} {new_fp}. If the change is expected, remove the old "
            f"entry with `ssh-keygen -R '{name}' -f {self.path}` and connect again; "
            f"a changed key is never accepted automatically.", host=shown)

    def _append(self, name: str, key: PKey) -> None:
        path = Path(self.path)
        prefix = ""
        if path.exists() and path.stat().st_size:
            with path.open("rb") as fh:
                fh.seek(-1, os.SEEK_END)
                prefix = "" if fh.read(1) == b"\n" else "\n"
        shown = hashed_name(name) if self.hash_names else name
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(f"{prefix}{shown} {key.get_name()} {key.get_base64()}\n")
