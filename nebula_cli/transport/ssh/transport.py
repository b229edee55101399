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
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import paramiko

from nebula_cli.errors import TransportError
from nebula_cli.transport import shellenv
from nebula_cli.transport.base import (
    DEFAULT_TIMEOUT,
    CommandResult,
    LineSplitter,
    OutputSink,
    shell_join,
)
from nebula_cli.transport.hostkeys import (
    SSH_PORT,
    ChangedHostKey,
    HostKeyError,
    KnownHosts,
    UnknownHostKey,
)
from nebula_cli.transport.keyfiles import key_identities
from nebula_cli.transport.sshconfig import (
    KNOWN_HOSTS_ENV,
    default_known_hosts,
    parse_destination,
    resolve,
)
from nebula_cli.transport.sshfiles import CHUNK as _CHUNK
from nebula_cli.transport.sshfiles import SftpFiles
from nebula_cli.transport.sshhost import SSHHost
from nebula_cli.transport.tree import DEFAULT_EXCLUDES

__all__ = [
    "AuthError", "ChangedHostKey", "DEFAULT_EXCLUDES", "HostKeyError", "SSHTimeout",
    "SSHTransport", "UnknownHostKey", "UnreachableError",
]

CONNECT_TIMEOUT = 15.0
KEEPALIVE = 15
MAX_CHANNELS = 8  # concurrent exec channels; + 1 SFTP session stays under sshd's MaxSessions 10
MAX_JUMP_DEPTH = 8
DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")


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


class SSHTransport(SSHHost):
    """A host reached over SSH. No network I/O until the first command or file operation."""

    _files: SftpFiles

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
        self.keepalive = keepalive
        self._fallback_keys = [os.path.expanduser(k) for k in fallback_keys]
        config_path = os.path.expanduser(ssh_config) if ssh_config else None
        target = resolve(host or name, user=user, port=port, key=key,
                         jump=jump if isinstance(jump, str) else None, config_path=config_path)
        super().__init__(name, target, python=python, home=home, connect_timeout=connect_timeout)
        self.known_hosts = self._known_hosts(known_hosts, accept_new_host_keys)
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
        self._channels = threading.BoundedSemaphore(max_channels)
        self._conn: paramiko.Transport | None = None
        self._sock: socket.socket | paramiko.Channel | None = None
        self.auth_method: str | None = None
        """How the last connection authenticated (`validate --hosts` shows it)."""

    def _known_hosts(self, explicit: str | None, accept_new: bool) -> KnownHosts:
        """The spec's (or $NEBULA_KNOWN_HOSTS) file alone; else ssh_config's
        UserKnownHostsFile (the first written) and GlobalKnownHostsFile, as `ssh` uses them."""
        tgt = self.target
        if explicit or os.environ.get(KNOWN_HOSTS_ENV):
            path = os.path.expanduser(explicit) if explicit else default_known_hosts()
            return KnownHosts(path, accept_new=accept_new, hash_names=tgt.hash_known_hosts)
        user_files = self.known_hosts_files(None)
        return KnownHosts(user_files[0], accept_new=accept_new, hash_names=tgt.hash_known_hosts,
                          extra_files=(*user_files[1:], *self.global_known_hosts_files()))

    def _make_files(self) -> SftpFiles:
        return SftpFiles(self, self._connection)

    def reached_as(self) -> str:
        auth = f"; auth {self.auth_method}" if self.auth_method else ""
        return f"nebula's ssh to {self.target.describe()}{auth}"

    def __repr__(self) -> str:
        via = f" via {self.jump.target}" if self.jump else ""
        return f"SSHTransport({self.name!r}, {self.target}{via})"

    def ssh_login(self) -> tuple[str, int, str]:
        key = self._connection().get_remote_server_key()  # verified at the handshake
        return self.target.user, self.target.port, f"{key.get_name()} {key.get_base64()}"

    @property
    def connection(self) -> paramiko.Transport | None:
        """The open paramiko connection, or None before first use / after close()."""
        conn = self._conn
        return conn if conn is not None and conn.is_active() else None

    # --- connection -------------------------------------------------------------------------

    def _connection(self) -> paramiko.Transport:
        self.check_open()
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
            for thing in (conn, sock):
                with contextlib.suppress(Exception):  # a ProxyCommand already reaped
                    thing.close()
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
        if tgt.proxy_command:
            return self._proxy(tgt.proxy_command)
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

    def _proxy(self, command: str) -> paramiko.ProxyCommand:
        """ssh_config's ProxyCommand, run as OpenSSH runs it (`sh -c 'exec ...'`): its
        standard input and output carry the SSH connection."""
        try:
            return paramiko.ProxyCommand(shell_join(["/bin/sh", "-c", f"exec {command}"]))
        except (OSError, paramiko.SSHException) as exc:
            raise UnreachableError(f"cannot start the ProxyCommand `{command}`: {exc}; check "
                                   f"it with `ssh -G {self.target.alias} | grep proxycommand`",
                                   host=self.name) from exc

    def _proxy_failed(self, conn: paramiko.Transport) -> None:
        """Raise UnreachableError naming the ProxyCommand when it has exited (what it said
        on stderr included); nothing when the link is not a ProxyCommand's or it still runs."""
        proxy = conn.sock
        process = getattr(proxy, "process", None)
        if not isinstance(proxy, paramiko.ProxyCommand) or process is None:
            return
        try:
            code = process.wait(timeout=1.0)
        except Exception:
            return
        said = ""
        if process.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                said = process.stderr.read().decode(errors="replace").strip()[-500:]
        raise UnreachableError(
            f"the ProxyCommand `{self.target.proxy_command}` exited {code} before the SSH "
            f"handshake{': ' + said if said else ''}; run it by hand (`ssh -v "
            f"{self.target.alias}` shows the same) and fix it in your ssh config",
            host=self.name)

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
            self._proxy_failed(conn)
            if time.monotonic() >= deadline:
                raise SSHTimeout(f"SSH handshake with {tgt} timed out after "
                                 f"{self.connect_timeout:g} s", host=self.name) from exc
            via = f" through ProxyCommand `{tgt.proxy_command}`" if tgt.proxy_command else ""
            raise TransportError(f"SSH handshake with {tgt}{via} failed: "
                                 f"{exc or type(exc).__name__}", host=self.name) from exc
        if not (conn.is_active() and conn.initial_kex_done):
            self._proxy_failed(conn)
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

    def _key_files(self, files: list[str], tried: list[str]
                   ) -> Iterator[tuple[str, paramiko.PKey]]:
        for path in files:
            yield from key_identities(path, self.target.certificate_files, tried,
                                      host=self.name)

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
                self.auth_method = f"publickey: {source}"
                return
            raise AuthError(
                f"{tgt} accepted {source} but asks for more (AuthenticationMethods, e.g. a "
                f"one-time code by keyboard-interactive), which nebula's built-in SSH does not "
                f"answer: set `transport: openssh` on this cluster, so that your own `ssh` "
                f"(and the master connection it keeps) reaches the host", host=self.name)
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
        sftp, conn, sock = self._files.drop(), self._conn, self._sock
        self._conn = self._sock = None
        for thing in (sftp, conn, sock):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
        if self._owns_jump and self.jump is not None:
            if self.aborted:
                self.jump.abort()
            self.jump.close()

    # --- commands ---------------------------------------------------------------------------

    def _wire_command(self, argv: Sequence[str] | str, env: Mapping[str, str] | None,
                      cwd: str | None) -> tuple[str, bytes]:
        """The command line for the server and what goes first on its standard input (see
        `shellenv.wrap`: environment values never appear on a command line)."""
        try:
            return shellenv.wrap(argv, env, self.remote_path(cwd) if cwd else None)
        except ValueError as exc:
            raise TransportError(str(exc), host=self.name) from exc

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
        wire, prefix = self._wire_command(argv, env, cwd)
        stdin = prefix + stdin if stdin else prefix or None
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

