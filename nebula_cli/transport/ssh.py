"""SSHTransport: one host over SSH (paramiko), one connection reused for every channel.

The connection opens on first use (fabric's `@opens` idea), is shared by all threads (opening
is guarded by a lock; exec channels run concurrently; one SFTP session serves file transfers),
reopens if it dropped, and is released by an idempotent `close()`. Host keys are checked
against known_hosts (see hostkeys.py); ProxyJump goes through a jump host that is itself an
SSHTransport, via a `direct-tcpip` channel. paramiko's errors are translated here into
TransportError subclasses whose messages name the host.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import posixpath
import re
import shlex
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import paramiko

from nebula_cli.errors import TransportError
from nebula_cli.transport.base import (
    DEFAULT_TIMEOUT,
    CommandResult,
    LineSplitter,
    OutputSink,
    Transport,
    shell_join,
)
from nebula_cli.transport.hostkeys import (
    GLOBAL_KNOWN_HOSTS,
    SSH_PORT,
    ChangedHostKey,
    HostKeyError,
    KnownHosts,
    UnknownHostKey,
)
from nebula_cli.transport.sshconfig import (
    KNOWN_HOSTS_ENV,
    SSHTarget,
    default_known_hosts,
    default_ssh_config,
    load_ssh_config,
    parse_destination,
    resolve,
)

__all__ = [
    "AuthError", "ChangedHostKey", "DEFAULT_EXCLUDES", "HostKeyError", "SSHTimeout",
    "SSHTransport", "UnknownHostKey", "UnreachableError",
]

CONNECT_TIMEOUT = 15.0
KEEPALIVE = 15
MAX_CHANNELS = 8  # concurrent exec channels; + 1 SFTP session stays under sshd's MaxSessions 10
SFTP_TIMEOUT = DEFAULT_TIMEOUT
MAX_JUMP_DEPTH = 8
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
DEFAULT_EXCLUDES = (".git", ".venv", "__pycache__", "*.pyc")
_CHUNK = 1 << 16
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class AuthError(TransportError):
    """The host refused every key offered."""


class UnreachableError(TransportError):
    """No TCP connection to the host (refused, no route, unknown name, jump host refused)."""


class SSHTimeout(TransportError):
    """Connecting, the SSH handshake or a command took longer than allowed."""


def _drain(read: Callable[[int], bytes], sink: list[bytes],
           lines: LineSplitter | None = None) -> None:
    with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
        while data := read(_CHUNK):
            sink.append(data)
            if lines is not None:
                lines.feed(data)


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    """Whether a relative posix path is excluded: any part, or the whole path, matches."""
    parts = rel.split("/")
    return any(fnmatch.fnmatchcase(part, pat) for pat in patterns for part in parts) or any(
        "/" in pat and fnmatch.fnmatchcase(rel, pat) for pat in patterns)


class SSHTransport(Transport):
    """A host reached over SSH. No network I/O until the first command or file operation."""

    def __init__(
        self,
        name: str,
        host: str | None = None,
        *,
        user: str | None = None,
        port: int | None = None,
        key: str | None = None,
        jump: str | SSHTransport | None = None,
        python: str | None = None,
        home: str = "~/.nebula",
        ssh_config: str | None = None,
        known_hosts: str | None = None,
        accept_new_host_keys: bool = False,
        connect_timeout: float = CONNECT_TIMEOUT,
        keepalive: int = KEEPALIVE,
        max_channels: int = MAX_CHANNELS,
        fallback_keys: Sequence[str] = (),
        _depth: int = 0,
    ) -> None:
        self.name = name
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self._python = python or "python3"
        self._fallback_keys = [os.path.expanduser(k) for k in fallback_keys]
        self._home = home
        config_path = os.path.expanduser(ssh_config) if ssh_config else default_ssh_config()
        self.target: SSHTarget = resolve(
            host or name, user=user, port=port, key=key,
            jump=jump if isinstance(jump, str) else None,
            config=load_ssh_config(config_path),
        )
        explicit_kh = known_hosts or os.environ.get(KNOWN_HOSTS_ENV)
        self.known_hosts = KnownHosts(
            os.path.expanduser(known_hosts) if known_hosts else default_known_hosts(),
            accept_new=accept_new_host_keys,
            extra_files=() if explicit_kh else (GLOBAL_KNOWN_HOSTS,),
        )
        self._owns_jump = False
        self.jump: SSHTransport | None = None
        if isinstance(jump, SSHTransport):
            self.jump = jump
        elif self.target.jump:
            if _depth >= MAX_JUMP_DEPTH:
                raise TransportError(
                    f"ProxyJump chain deeper than {MAX_JUMP_DEPTH} hops (a loop in ssh config?)",
                    host=name)
            hops = [h.strip() for h in self.target.jump.split(",") if h.strip()]
            j_user, j_host, j_port = parse_destination(hops[-1])
            self.jump = SSHTransport(
                f"{hops[-1]} (jump host of {name})", j_host, user=j_user, port=j_port,
                jump=",".join(hops[:-1]) or None, ssh_config=config_path,
                known_hosts=known_hosts, accept_new_host_keys=accept_new_host_keys,
                connect_timeout=connect_timeout, keepalive=keepalive,
                fallback_keys=[*self.target.identity_files, *self._fallback_keys],
                _depth=_depth + 1,
            )
            self._owns_jump = True
        self._lock = threading.Lock()
        self._sftp_lock = threading.RLock()
        self._channels = threading.BoundedSemaphore(max_channels)
        self._conn: paramiko.Transport | None = None
        self._sock: socket.socket | paramiko.Channel | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_conn: paramiko.Transport | None = None
        self._remote_home: str | None = None

    def __repr__(self) -> str:
        via = f" via {self.jump.target}" if self.jump else ""
        return f"SSHTransport({self.name!r}, {self.target}{via})"

    # --- properties -------------------------------------------------------------------------

    @property
    def home(self) -> str:
        return self.remote_path(self._home)

    @property
    def python(self) -> str:
        return self._python

    @property
    def connection(self) -> paramiko.Transport | None:
        """The open paramiko connection, or None before first use / after close()."""
        conn = self._conn
        return conn if conn is not None and conn.is_active() else None

    def remote_path(self, path: str) -> str:
        """`path` made absolute on the host: `~` and `~/x` expand to the remote home,
        relative paths are taken from the home directory (as ssh and sftp do)."""
        if path.startswith("/"):
            return path
        home = self._home_dir()
        if path in ("~", ""):
            return home
        if path.startswith("~/"):
            path = path[2:]
        elif path.startswith("~"):
            raise TransportError(f"cannot expand {path!r}: only ~/ paths are supported",
                                 host=self.name)
        return posixpath.normpath(posixpath.join(home, path))

    # --- connection -------------------------------------------------------------------------

    def _connection(self) -> paramiko.Transport:
        conn = self._conn
        if conn is not None and conn.is_active():
            return conn
        with self._lock:
            conn = self._conn
            if conn is not None and conn.is_active():
                return conn
            self._drop()
            self._conn, self._sock = self._open()
            return self._conn

    def _open(self) -> tuple[paramiko.Transport, socket.socket | paramiko.Channel]:
        deadline = time.monotonic() + self.connect_timeout
        sock = self._dial(deadline)
        conn = paramiko.Transport(sock)
        try:
            self._handshake(conn, deadline)
            self._authenticate(conn, deadline)
            conn.set_keepalive(self.keepalive)
        except BaseException:
            conn.close()
            sock.close()
            raise
        return conn, sock

    def _dial(self, deadline: float) -> socket.socket | paramiko.Channel:
        tgt = self.target
        where = f"{tgt.hostname}:{tgt.port}"
        remaining = max(deadline - time.monotonic(), 0.01)
        if self.jump is not None:
            via = self.jump._connection()
            try:
                return via.open_channel("direct-tcpip", (tgt.hostname, tgt.port),
                                        ("127.0.0.1", 0), timeout=remaining)
            except paramiko.ChannelException as exc:
                raise UnreachableError(
                    f"jump host {self.jump.target} cannot reach {where}: {exc.text}",
                    host=self.name) from exc
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise SSHTimeout(f"no channel to {where} through jump host "
                                     f"{self.jump.target} within {self.connect_timeout:g} s",
                                     host=self.name) from exc
                raise TransportError(f"cannot open a channel to {where} through jump host "
                                     f"{self.jump.target}: {exc}", host=self.name) from exc
        try:
            return socket.create_connection((tgt.hostname, tgt.port), timeout=remaining)
        except TimeoutError as exc:
            raise SSHTimeout(f"connecting to {where} timed out after "
                             f"{self.connect_timeout:g} s", host=self.name) from exc
        except socket.gaierror as exc:
            raise UnreachableError(f"cannot resolve host name {tgt.hostname!r}: {exc.strerror}",
                                   host=self.name) from exc
        except ConnectionRefusedError as exc:
            raise UnreachableError(f"connection refused by {where} (is sshd running there, "
                                   f"on that port?)", host=self.name) from exc
        except OSError as exc:
            raise UnreachableError(f"cannot reach {where}: {exc.strerror or exc}",
                                   host=self.name) from exc

    def _handshake(self, conn: paramiko.Transport, deadline: float) -> None:
        tgt = self.target
        kh_host, kh_port = (tgt.host_key_alias, SSH_PORT) if tgt.host_key_alias else (
            tgt.hostname, tgt.port)
        conn.banner_timeout = conn.handshake_timeout = self.connect_timeout
        conn.auth_timeout = self.connect_timeout
        self._prefer_known_key_types(conn, self.known_hosts.known_types(kh_host, kh_port))
        try:
            conn.start_client(timeout=max(deadline - time.monotonic(), 0.01))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise SSHTimeout(f"SSH handshake with {tgt} timed out after "
                                 f"{self.connect_timeout:g} s", host=self.name) from exc
            raise TransportError(f"SSH handshake with {tgt} failed: {exc or type(exc).__name__}",
                                 host=self.name) from exc
        if not (conn.is_active() and conn.initial_kex_done):
            raise SSHTimeout(f"SSH handshake with {tgt} timed out after "
                             f"{self.connect_timeout:g} s", host=self.name)
        self.known_hosts.verify(kh_host, kh_port, conn.get_remote_server_key(), display=self.name)

    @staticmethod
    def _prefer_known_key_types(conn: paramiko.Transport, known: list[str]) -> None:
        """Ask for the recorded key types first, as OpenSSH does."""
        if not known:
            return
        opts = conn.get_security_options()
        available = list(opts.key_types)
        wanted: list[str] = []
        for kind in known:
            algs = ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if kind == "ssh-rsa" else [kind]
            wanted += [a for a in algs if a in available and a not in wanted]
        opts.key_types = wanted + [a for a in available if a not in wanted]

    def _identities(self, tried: list[str]) -> Iterator[tuple[str, paramiko.PKey]]:
        """Keys to offer, in order: explicit / IdentityFile keys, the agent, default files,
        then the fallback keys (a jump host also tries the key of the host behind it)."""
        tgt = self.target
        files = list(tgt.identity_files)
        defaults_later = not files and not tgt.identities_only
        if defaults_later:
            files = [p for p in map(os.path.expanduser, DEFAULT_IDENTITIES) if os.path.exists(p)]
        else:
            yield from self._key_files(files, tried)
        if not tgt.identities_only:
            agent = paramiko.Agent()
            try:
                for i, key in enumerate(agent.get_keys()):
                    yield f"agent key {i + 1} ({key.get_name()})", key
            finally:
                agent.close()
        if defaults_later:
            yield from self._key_files(files, tried)
        yield from self._key_files([k for k in self._fallback_keys if k not in files], tried)

    @staticmethod
    def _key_files(files: list[str], tried: list[str]) -> Iterator[tuple[str, paramiko.PKey]]:
        for path in files:
            try:
                yield path, paramiko.PKey.from_path(path)
            except FileNotFoundError:
                tried.append(f"{path} (missing)")
            except paramiko.PasswordRequiredException:
                tried.append(f"{path} (encrypted: load it into ssh-agent)")
            except (OSError, ValueError, paramiko.SSHException) as exc:
                tried.append(f"{path} (unreadable: {exc})")

    def _authenticate(self, conn: paramiko.Transport, deadline: float) -> None:
        tgt = self.target
        tried: list[str] = []
        for source, key in self._identities(tried):
            try:
                conn.auth_publickey(tgt.user, key)
            except paramiko.AuthenticationException:
                tried.append(source)
                continue
            except (paramiko.SSHException, EOFError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise SSHTimeout(f"authentication to {tgt} timed out", host=self.name) from exc
                raise TransportError(f"connection to {tgt} lost during authentication: {exc}",
                                     host=self.name) from exc
            if conn.is_authenticated():
                return
            tried.append(f"{source} (more authentication steps required; not supported)")
        offered = "; ".join(tried) or (
            "no key found: set `key:` in the spec, IdentityFile in ssh config, or load ssh-agent")
        raise AuthError(f"authentication failed for {tgt} (publickey); tried: {offered}",
                        host=self.name)

    def _answers(self, conn: paramiko.Transport) -> bool:
        """Whether the server still answers (like OpenSSH's ServerAliveInterval): a global
        request it must reply to, waited for at most `keepalive` seconds."""
        if not conn.is_active():
            return False
        probe = threading.Thread(
            target=lambda: conn.global_request("keepalive@openssh.com", wait=True), daemon=True)
        probe.start()
        probe.join(self.keepalive)
        return not probe.is_alive()

    def _drop(self) -> None:
        """Forget the current connection (caller holds self._lock)."""
        sftp, conn, sock = self._sftp, self._conn, self._sock
        self._sftp = self._sftp_conn = None
        self._conn = self._sock = None
        for thing in (sftp, conn, sock):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
        if self._owns_jump and self.jump is not None:
            self.jump.close()

    # --- commands ---------------------------------------------------------------------------

    def _wire_command(self, argv: Sequence[str] | str, env: Mapping[str, str] | None,
                      cwd: str | None) -> str:
        """The command line sent to the server: `cd DIR && env K=V ... COMMAND`.

        A string command given with env or cwd runs as `/bin/sh -c COMMAND`, so that every
        part of it sees them; otherwise the login shell reads it as it is."""
        wrap = bool(env or cwd)
        body = (f"/bin/sh -c {shlex.quote(argv)}" if wrap else argv) if isinstance(
            argv, str) else shlex.join(argv)
        if env:
            for key in env:
                if not _ENV_NAME.fullmatch(key):
                    raise TransportError(f"invalid environment variable name {key!r}",
                                         host=self.name)
            assigns = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items())
            body = f"env {assigns} {body}"
        if cwd:
            body = f"cd {shlex.quote(self.remote_path(cwd))} && {body}"
        return body

    def run(
        self,
        argv: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        stdin: bytes | None = None,
        on_output: OutputSink | None = None,
    ) -> CommandResult:
        command = shell_join(argv)
        deadline = time.monotonic() + timeout
        wire = self._wire_command(argv, env, cwd)
        conn = self._connection()
        if not self._channels.acquire(timeout=max(deadline - time.monotonic(), 0)):
            raise SSHTimeout(f"no free channel for `{command}` within {timeout:g} s",
                             host=self.name)
        try:
            try:
                chan = conn.open_session(timeout=self.connect_timeout)
                chan.exec_command(wire)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                raise TransportError(f"cannot start `{command}`: {exc}", host=self.name) from exc
            try:
                return self._collect(conn, chan, command, stdin, deadline, timeout, on_output)
            finally:
                chan.close()
        finally:
            self._channels.release()

    def _collect(self, conn: paramiko.Transport, chan: paramiko.Channel, command: str,
                 stdin: bytes | None, deadline: float, timeout: float,
                 on_output: OutputSink | None = None) -> CommandResult:
        out: list[bytes] = []
        err: list[bytes] = []
        lines = LineSplitter(on_output) if on_output is not None else None
        readers = [threading.Thread(target=_drain, args=(chan.recv, out, lines), daemon=True),
                   threading.Thread(target=_drain, args=(chan.recv_stderr, err, lines),
                                    daemon=True)]
        for reader in readers:
            reader.start()

        def timed_out(exc: BaseException | None = None) -> SSHTimeout:
            chan.close()
            for reader in readers:
                reader.join(1.0)
            error = SSHTimeout(f"`{command}` did not finish within {timeout:g} s "
                               f"(channel closed)", host=self.name)
            error.__cause__ = exc
            return error

        try:
            if stdin:
                chan.settimeout(max(deadline - time.monotonic(), 0.01))
                chan.sendall(stdin)
            chan.shutdown_write()
        except TimeoutError as exc:
            raise timed_out(exc) from exc
        except OSError:
            pass  # the command exited without reading its input; its status tells the story
        while any(r.is_alive() for r in readers) and time.monotonic() < deadline:
            for reader in readers:
                reader.join(min(self.keepalive, max(deadline - time.monotonic(), 0)))
            if any(r.is_alive() for r in readers) and not self._answers(conn):
                chan.close()
                with self._lock:
                    if self._conn is conn:
                        self._drop()
                raise UnreachableError(
                    f"connection lost while running `{command}`: no answer to a keepalive "
                    f"within {self.keepalive} s", host=self.name)
        if any(r.is_alive() for r in readers) or not chan.status_event.wait(
                max(deadline - time.monotonic(), 0)):
            raise timed_out()
        if lines is not None:
            lines.close()
        if chan.exit_status == -1 and not conn.is_active():
            raise TransportError(f"connection lost while running `{command}`", host=self.name)
        return CommandResult(
            command=command,
            exit_code=chan.exit_status,  # -1 when the command died by a signal
            stdout=b"".join(out).decode(errors="replace"),
            stderr=b"".join(err).decode(errors="replace"),
        )

    # --- files ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _sftp_session(self, what: str) -> Iterator[paramiko.SFTPClient]:
        """The one SFTP session (opened on demand), held exclusively; errors translated."""
        conn = self._connection()
        with self._sftp_lock:
            try:
                if self._sftp is None or self._sftp_conn is not conn:
                    self._sftp = paramiko.SFTPClient.from_transport(conn)
                    if self._sftp is None:
                        raise paramiko.SSHException("the server refused the sftp subsystem")
                    self._sftp.get_channel().settimeout(SFTP_TIMEOUT)
                    self._sftp_conn = conn
                yield self._sftp
            except (OSError, EOFError, paramiko.SSHException) as exc:
                detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise TransportError(f"cannot {what}: {detail or type(exc).__name__}",
                                     host=self.name) from exc

    def _home_dir(self) -> str:
        if self._remote_home is None:
            with self._sftp_session("find the remote home directory") as sftp:
                self._remote_home = sftp.normalize(".")
        return self._remote_home

    def _upload(self, sftp: paramiko.SFTPClient, src: IO[bytes], path: str, mode: int,
                mtime: float | None = None, sent: Callable[[int], None] | None = None) -> int:
        """Write `src` to a temporary name next to `path`, set mode (before any data) and mtime,
        then rename it over `path`. Returns the bytes written."""
        parent, base = posixpath.split(path)
        tmp = posixpath.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
        total = 0
        try:
            with sftp.open(tmp, "wb") as fh:
                fh.set_pipelined(True)
                fh.chmod(mode)
                while chunk := src.read(1 << 18):
                    fh.write(chunk)
                    total += len(chunk)
                    if sent is not None:
                        sent(len(chunk))
            if mtime is not None:
                sftp.utime(tmp, (int(mtime), int(mtime)))
            sftp.posix_rename(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                sftp.remove(tmp)
            raise
        return total

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o644) -> None:
        path = self.remote_path(remote)
        with self._sftp_session(f"write {path}") as sftp:
            self._mkdirs(sftp, posixpath.dirname(path), 0o755)
            self._upload(sftp, io.BytesIO(data), path, mode)

    def put(self, local: str, remote: str, *, mode: int | None = None) -> None:
        path = self.remote_path(remote)
        try:
            src = open(local, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise TransportError(f"cannot copy {local} to {path}: {exc}", host=self.name) from exc
        with src, self._sftp_session(f"copy {local} to {path}") as sftp:
            self._mkdirs(sftp, posixpath.dirname(path), 0o755)
            file_mode = mode if mode is not None else os.fstat(src.fileno()).st_mode & 0o7777
            self._upload(sftp, src, path, file_mode)

    def get(self, remote: str, local: str) -> None:
        path = self.remote_path(remote)
        target = Path(local)
        try:
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        except OSError as exc:
            raise TransportError(f"cannot copy {path} to {local}: {exc}", host=self.name) from exc
        try:
            with os.fdopen(fd, "wb") as fh, self._sftp_session(f"copy {path} to {local}") as sftp:
                sftp.getfo(path, fh)
            os.replace(tmp, target)
        except OSError as exc:
            raise TransportError(f"cannot copy {path} to {local}: {exc}", host=self.name) from exc
        finally:
            Path(tmp).unlink(missing_ok=True)

    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        path = self.remote_path(remote)
        with self._sftp_session(f"read {path}") as sftp:
            try:
                fh = sftp.open(path, "rb")
            except FileNotFoundError:
                return b"", offset
            with fh:
                size = fh.stat().st_size or 0
                if size < offset:
                    offset = 0
                want = min(max_bytes, size - offset)
                fh.seek(offset)
                if want > _CHUNK:
                    fh.prefetch(offset + want)
                data = fh.read(want) if want > 0 else b""
        return data, offset + len(data)

    def _mkdirs(self, sftp: paramiko.SFTPClient, path: str, mode: int) -> None:
        try:
            if stat.S_ISDIR(sftp.stat(path).st_mode or 0):
                return
            raise TransportError(f"cannot make directory {path}: a file is in the way",
                                 host=self.name)
        except FileNotFoundError:
            pass
        parent = posixpath.dirname(path)
        if parent and parent != path:
            self._mkdirs(sftp, parent, mode)
        try:
            sftp.mkdir(path, mode)
        except OSError:
            if not stat.S_ISDIR(sftp.stat(path).st_mode or 0):  # lost a race: fine if a dir
                raise

    def makedirs(self, remote: str, *, mode: int = 0o755) -> None:
        path = self.remote_path(remote)
        with self._sftp_session(f"make directory {path}") as sftp:
            self._mkdirs(sftp, path, mode)

    def exists(self, remote: str) -> bool:
        path = self.remote_path(remote)
        with self._sftp_session(f"check {path}") as sftp:
            try:
                sftp.stat(path)
            except (FileNotFoundError, PermissionError):
                return False
        return True

    def sync_dir(
        self,
        local_dir: str,
        remote_dir: str,
        exclude: Sequence[str] = DEFAULT_EXCLUDES,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[int, int]:
        """Upload a directory tree, skipping files whose remote copy has the same size and
        mtime (uploads get the local mtime). `exclude`: fnmatch patterns matched against every
        path part (or the whole relative path when a pattern has a '/'). Remote files not
        present locally are left alone. `progress(bytes_sent, bytes_to_send)` is called as
        data goes out. Returns (files_sent, bytes_sent)."""
        root = Path(local_dir)
        if not root.is_dir():
            raise TransportError(f"cannot sync {local_dir}: not a directory", host=self.name)
        dirs: list[str] = []
        files: list[tuple[str, Path, os.stat_result]] = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root).as_posix()
            rel_dir = "" if rel_dir == "." else rel_dir
            dirnames[:] = sorted(d for d in dirnames
                                 if not _excluded(posixpath.join(rel_dir, d), exclude))
            dirs.append(rel_dir)
            for fname in sorted(filenames):
                rel = posixpath.join(rel_dir, fname)
                if _excluded(rel, exclude):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, fname))
                except OSError:
                    continue  # a dangling symlink
                if stat.S_ISREG(st.st_mode):
                    files.append((rel, Path(dirpath, fname), st))
        base = self.remote_path(remote_dir)
        by_dir: dict[str, list[tuple[str, Path, os.stat_result]]] = {}
        for item in files:
            by_dir.setdefault(posixpath.dirname(item[0]), []).append(item)
        with self._sftp_session(f"sync {local_dir} to {base}") as sftp:
            todo = []
            for rel_dir in dirs:
                rdir = posixpath.join(base, rel_dir) if rel_dir else base
                self._mkdirs(sftp, rdir, 0o755)
                remote = {a.filename: a for a in sftp.listdir_attr(rdir)}
                for rel, lpath, st in by_dir.get(rel_dir, []):
                    attr = remote.get(posixpath.basename(rel))
                    if (attr is not None and stat.S_ISREG(attr.st_mode or 0)
                            and attr.st_size == st.st_size
                            and attr.st_mtime == int(st.st_mtime)):
                        continue
                    todo.append((rel, lpath, st))
            total = sum(st.st_size for _, _, st in todo)
            done = 0

            def sent(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(done, total)

            for rel, lpath, st in todo:
                with open(lpath, "rb") as src:
                    self._upload(sftp, src, posixpath.join(base, rel), st.st_mode & 0o7777,
                                 mtime=st.st_mtime, sent=sent)
        if progress is not None:
            progress(done, total)
        return len(todo), done
