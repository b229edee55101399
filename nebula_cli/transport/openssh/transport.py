"""OpenSSHTransport: one host through the user's own `ssh` client and one master connection.

For hosts nebula's built-in client cannot log in to by itself: a one-time code asked after the
key (`AuthenticationMethods publickey,keyboard-interactive`), GSSAPI/Kerberos, a FIDO key, an
agent that holds certificates, or anything else the user's `ssh` and ssh_config handle.

The first operation starts a master connection (`ssh -M -N -f`, OpenSSH's ControlMaster):
`ssh` itself authenticates, asking on the terminal what it must (a code, a passphrase),
then goes to the background and stays for `ControlPersist`. Every command is then a session
multiplexed over that master (`ControlMaster=no`), so `status`, `logs` and `stop`, later
and from other processes, ask nothing again while the master lives. Masters are started one
at a time (one prompt at a time on the terminal); without a terminal, `BatchMode` makes a host
that needs an answer one error naming the host and the fix. Nothing of the credentials is
kept by nebula: the master is OpenSSH's own process, its socket in `control_dir` (0700, this
user's, no symlink: checked before a socket there is used).

Files go over exec sessions (`execfiles.ExecFiles`: sh, base64, tar), as for a host without
SFTP. Host keys are OpenSSH's business (`StrictHostKeyChecking yes`, or `accept-new` with
`--accept-new-host-keys`); `ssh_login` reports the key on record in its known_hosts.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from nebula_cli.errors import TransportError
from nebula_cli.ownership import not_own_folder
from nebula_cli.transport import shellenv
from nebula_cli.transport.base import (
    DEFAULT_TIMEOUT,
    CommandResult,
    LineSplitter,
    OutputSink,
    shell_join,
)
from nebula_cli.transport.execfiles import ExecFiles
from nebula_cli.transport.hostkeys import SSH_PORT, KnownHosts
from nebula_cli.transport.openssh_config import ssh_binary
from nebula_cli.transport.ssh.transport import (
    CONNECT_TIMEOUT,
    AuthError,
    HostKeyError,
    SSHTimeout,
    UnreachableError,
)
from nebula_cli.transport.sshconfig import (
    KNOWN_HOSTS_ENV,
    SSH_CONFIG_ENV,
    resolve,
)
from nebula_cli.transport.sshhost import SSHHost

CONTROL_DIR = "~/.nebula/ssh"
"""Where the masters' sockets live (short: a socket path has at most 104 bytes)."""
CONTROL_PERSIST = "8h"
"""How long a master stays after its last session (OpenSSH's ControlPersist); a site's
sshd may end it sooner."""
SERVER_ALIVE = 15
"""Seconds between keepalives on the master (ServerAliveInterval)."""
_masters_lock = threading.Lock()
"""Masters start one at a time: prompts on the terminal never interleave."""


def _terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno()) and os.path.exists("/dev/tty")
    except (AttributeError, OSError, ValueError):
        return False


def _auth_method(log: str) -> str | None:
    """How `ssh -v` says it logged in: the method(s) and the key the server accepted."""
    methods = [line.split(" using ", 1)[1].strip(' ."') for line in log.splitlines()
               if "Authenticated to" in line and " using " in line]
    keys = [line.split("Server accepts key:", 1)[1].split()[0] for line in log.splitlines()
            if "Server accepts key:" in line]
    partial = [line.split("Authenticated using ", 1)[1].split()[0].strip('"')
               for line in log.splitlines() if "Authenticated using" in line]
    if not methods:
        return None
    steps = [*partial, *methods]
    return ", then ".join(dict.fromkeys(steps)) + (f" (key {keys[-1]})" if keys else "")


class OpenSSHTransport(SSHHost):
    """A host reached with the user's `ssh` over a master connection (see the module)."""

    def __init__(
        self,
        name: str,
        host: str | None = None,
        *,
        user: str | None = None,
        port: int | None = None,
        key: str | None = None,
        jump: str | None = None,
        python: str | None = None,
        home: str = "~/.nebula",
        ssh_config: str | None = None,
        known_hosts: str | None = None,
        accept_new_host_keys: bool = False,
        connect_timeout: float = CONNECT_TIMEOUT,
        control_dir: str | None = None,
        control_persist: str = CONTROL_PERSIST,
    ) -> None:
        if ssh_binary() is None:
            raise TransportError("`transport: openssh` needs OpenSSH's `ssh` client on PATH",
                                 host=name)
        self._alias = host or name
        named = ssh_config or os.environ.get(SSH_CONFIG_ENV)
        self._config = os.path.expanduser(named) if named else None
        target = resolve(self._alias, user=user, port=port, key=key, jump=jump,
                         config_path=self._config)
        super().__init__(name, target, python=python, home=home, connect_timeout=connect_timeout)
        self._user, self._port, self._key, self._jump = user, port, key, jump
        named = known_hosts or os.environ.get(KNOWN_HOSTS_ENV)
        self._known_hosts = os.path.expanduser(named) if named else None
        self._accept_new = accept_new_host_keys
        self._control_dir = os.path.expanduser(control_dir or CONTROL_DIR)
        self._persist = control_persist
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._procs_lock = threading.Lock()
        self._master_ok = False
        self.auth_method: str | None = None
        """How the master authenticated, as `ssh -v` said (`validate --hosts` shows it)."""

    def _make_files(self) -> ExecFiles:
        return ExecFiles(self)

    def reached_as(self) -> str:
        auth = f"; auth {self.auth_method}" if self.auth_method else ""
        return (f"your ssh (master {self.control_path}) to {self.target.describe()}{auth}")

    def __repr__(self) -> str:
        return f"OpenSSHTransport({self.name!r}, {self.target})"

    # --- how ssh is called --------------------------------------------------------------------

    @property
    def control_path(self) -> str:
        """The master's socket (OpenSSH's %C: a hash of this host, port, user and jump)."""
        return posixpath.join(self._control_dir, "%C")

    def _options(self) -> list[str]:
        """`ssh` options before the destination: the user's config, nebula's explicit fields,
        the master's socket, host key policy."""
        argv = [ssh_binary() or "ssh"]
        if self._config is not None:
            argv += ["-F", self._config if os.path.exists(self._config) else "none"]
        if self._user:
            argv += ["-l", self._user]
        if self._port:
            argv += ["-p", str(self._port)]
        if self._key:
            argv += ["-i", os.path.expanduser(self._key), "-o", "IdentitiesOnly=yes"]
        if self._jump and self._jump.strip().lower() != "none":
            argv += ["-J", self._jump]
        if self._known_hosts:
            argv += ["-o", f"UserKnownHostsFile={self._known_hosts}"]
        policy = "accept-new" if self._accept_new else "yes"
        return [*argv, "-o", f"StrictHostKeyChecking={policy}",
                "-o", f"ControlPath={self.control_path}",
                "-o", f"ConnectTimeout={max(int(self.connect_timeout), 1)}",
                "-o", f"ServerAliveInterval={SERVER_ALIVE}", "-o", "ServerAliveCountMax=3"]

    def _private_control_dir(self) -> None:
        """The masters' folder, made 0700 if missing; refused (naming the host and the fix)
        when it is a symlink, not a folder, or another user's: whoever controls it could put
        their own master's socket where ours is looked for, and have our sessions run over
        it."""
        path = self._control_dir
        os.makedirs(path, mode=0o700, exist_ok=True)
        why = not_own_folder(path)
        if why is None:
            os.chmod(path, 0o700)
            return
        raise TransportError(
            f"OpenSSH's control folder {path} {why}, so a master socket in it may not be "
            f"yours: remove it (`rm -r {path}`; nebula makes it again, yours and 0700)",
            host=self.name)

    def _check_master(self) -> bool:
        proc = subprocess.run([*self._options(), "-O", "check", "--", self._alias],
                              capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        return proc.returncode == 0

    def _master(self) -> None:
        """Start the master connection unless one is up (the user's own, at the same socket,
        counts): `ssh` authenticates, asking on the terminal if it must."""
        self.check_open()
        if self._master_ok:  # a master that died since shows as exit 255 (`_collect`)
            return
        with _masters_lock:
            self._private_control_dir()  # before a socket in it is trusted as our master
            if self._check_master():
                self._master_ok = True
                return
            tty = _terminal()
            with tempfile.NamedTemporaryFile(prefix="nebula-ssh-", suffix=".log") as log_file:
                # -E: ssh's log to a file (a master in the background keeps no pipe of ours
                # open); ssh asks its questions on /dev/tty, the user's terminal.
                argv = [*self._options(), "-M", "-N", "-f", "-v", "-E", log_file.name,
                        "-o", f"ControlPersist={self._persist}",
                        "-o", f"BatchMode={'no' if tty else 'yes'}", "--", self._alias]
                try:
                    proc = subprocess.run(argv, stdin=None if tty else subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=log_file,
                                          timeout=self.connect_timeout + (300 if tty else 15))
                except subprocess.TimeoutExpired as exc:
                    raise SSHTimeout(f"`ssh` did not log in to {self.target} within "
                                     f"{self.connect_timeout:g} s", host=self.name) from exc
                log = log_file.read().decode(errors="replace")
            if proc.returncode != 0:
                raise self._login_error(log, tty)
            self.auth_method = _auth_method(log)
            self._master_ok = True

    def _login_error(self, log: str, tty: bool) -> TransportError:
        said = [line for line in log.splitlines() if not line.startswith("debug")]
        tail = "; ".join(said[-3:]) or "no message"
        kbd = "keyboard-interactive" in log and "Permission denied" in log
        if "Host key verification failed" in log or "REMOTE HOST IDENTIFICATION" in log:
            return HostKeyError(
                f"OpenSSH could not verify the host key of {self.target}: {tail}. Check the "
                f"key with the host's administrator, then `ssh {self._alias}` once to record "
                f"it, or pass --accept-new-host-keys", host=self.name)
        if kbd and not tty:
            return AuthError(
                f"{self.target} asks for keyboard-interactive answers (a one-time code?) and "
                f"there is no terminal to ask on: run nebula in a terminal, or open the master "
                f"connection first with `{shell_join(self._master_hint())}` and run nebula "
                f"again while it lives", host=self.name)
        if "Permission denied" in log or "Too many authentication failures" in log:
            return AuthError(f"`ssh` could not log in to {self.target}: {tail}; `ssh -v "
                             f"{self._alias}` shows what was tried", host=self.name)
        if "timed out" in log:
            return SSHTimeout(f"`ssh` to {self.target}: {tail}", host=self.name)
        return UnreachableError(f"`ssh` to {self.target} failed: {tail}", host=self.name)

    def _master_hint(self) -> list[str]:
        """The command a user runs to open the master by hand."""
        opts = self._options()
        return [*opts[:1], "-M", "-N", "-f", *opts[1:], "-o",
                f"ControlPersist={self._persist}", self._alias]

    def exit_master(self) -> None:
        """End the master connection (`ssh -O exit`); the next operation starts a new one."""
        self._master_ok = False
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*self._options(), "-O", "exit", "--", self._alias],
                           capture_output=True, timeout=30, stdin=subprocess.DEVNULL)

    def ssh_login(self) -> tuple[str, int, str] | None:
        """The host's key as its known_hosts records it (the one OpenSSH verified)."""
        self._master()
        tgt = self.target
        host, port = (tgt.host_key_alias, SSH_PORT) if tgt.host_key_alias else (
            tgt.hostname, tgt.port)
        files = self.known_hosts_files(self._known_hosts)
        extra = [*files[1:], *self.global_known_hosts_files()]
        recorded = KnownHosts(files[0], extra_files=extra).recorded(host, port)
        if not recorded:
            raise TransportError(f"no host key of {host}:{port} on record in {files[0]}",
                                 host=self.name)
        return tgt.user, tgt.port, recorded[0]

    # --- commands -----------------------------------------------------------------------------

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
        try:
            wire, prefix = shellenv.wrap(argv, env, self.remote_path(cwd) if cwd else None)
        except ValueError as exc:
            raise TransportError(str(exc), host=self.name) from exc
        data = prefix + stdin if stdin else prefix
        self._master()
        ssh = [*self._options(), "-o", "ControlMaster=no", "-o", "BatchMode=yes", "-T",
               "--", self._alias, wire]
        proc = subprocess.Popen(ssh, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        with self._procs_lock:
            self._procs.add(proc)
        try:
            return self._collect(proc, command, data, timeout, on_output)
        finally:
            with self._procs_lock:
                self._procs.discard(proc)

    def _collect(self, proc: subprocess.Popen[bytes], command: str, data: bytes,
                 timeout: float, on_output: OutputSink | None) -> CommandResult:
        out: list[bytes] = []
        err: list[bytes] = []
        lines = LineSplitter(on_output) if on_output is not None else None

        def drain(stream: object, sink: list[bytes]) -> None:
            read = stream.read1  # type: ignore[attr-defined]
            with contextlib.suppress(OSError, ValueError):
                while chunk := read(65536):
                    sink.append(chunk)
                    if lines is not None:
                        lines.feed(chunk)

        readers = [threading.Thread(target=drain, args=(proc.stdout, out), daemon=True),
                   threading.Thread(target=drain, args=(proc.stderr, err), daemon=True)]
        for reader in readers:
            reader.start()
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            if data:
                proc.stdin.write(data)
            proc.stdin.close()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.wait()
            raise SSHTimeout(f"`{command}` did not finish within {timeout:g} s (session "
                             f"closed)", host=self.name) from exc
        for reader in readers:
            reader.join(5.0)
        if lines is not None:
            lines.close()
        stderr = b"".join(err).decode(errors="replace")
        if self.aborted:
            raise TransportError("cancelled: the connection was closed", host=self.name)
        if code == 255 and not self._check_master():
            self._master_ok = False
            raise UnreachableError(f"the master connection to {self.target} is gone while "
                                   f"running `{command}`: {stderr.strip()[-300:]}",
                                   host=self.name)
        return CommandResult(command=command, exit_code=code,
                             stdout=b"".join(out).decode(errors="replace"), stderr=stderr)

    def close(self) -> None:
        """Sessions still running end; the master stays (for `status`, `logs`, `stop`)."""
        with self._procs_lock:
            procs = list(self._procs)
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.kill()
        deadline = time.monotonic() + 5
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(deadline - time.monotonic(), 0.1))

