"""SSHHost: what the two SSH transports share, nebula's own client (`ssh.SSHTransport`) and the
user's `ssh` over a master (`openssh.OpenSSHTransport`).

A host reached by SSH: its name, its resolved `SSHTarget`, its python and nebula home; its
address as ssh_config resolved it; services bind every interface; nothing is shared with this
machine; a free port found by running Python there; paths made absolute from the remote home;
its known_hosts files as ssh_config names them. The files themselves go through a
`RemoteFiles` the subclass composes (SFTP with an exec fallback, or exec sessions), given
absolute paths: the transport owns the paths, the files object only moves bytes.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from nebula_cli.errors import TransportError
from nebula_cli.transport.base import Transport, home_relative
from nebula_cli.transport.freeport import FREE_PORT_PY
from nebula_cli.transport.hostkeys import GLOBAL_KNOWN_HOSTS
from nebula_cli.transport.sshconfig import SSHTarget, default_known_hosts
from nebula_cli.transport.tree import DEFAULT_EXCLUDES


class RemoteFiles(Protocol):
    """File operations on a host, absolute paths only (`execfiles.ExecFiles`,
    `sshfiles.SftpFiles`)."""

    def home(self) -> str: ...

    def write(self, data: bytes, path: str, mode: int) -> None: ...

    def put(self, local: str, path: str, mode: int | None) -> None: ...

    def get(self, path: str, local: str) -> None: ...

    def read_tail(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]: ...

    def makedirs(self, path: str, mode: int) -> None: ...

    def exists(self, path: str) -> bool: ...

    def upload_tree(self, local_dir: str, base: str, exclude: Sequence[str],
                    progress: Callable[[int, int], None] | None) -> tuple[int, int]: ...


class SSHHost(Transport):
    """The part of a transport that reaches its host by SSH (see the module). A subclass
    composes its files (`_make_files`) and implements `run`, `close` and `ssh_login`."""

    def __init__(self, name: str, target: SSHTarget, *, python: str | None, home: str,
                 connect_timeout: float) -> None:
        self.name = name
        self.target = target
        self.connect_timeout = connect_timeout
        self._python = python or "python3"
        self._home = home
        self._remote_home: str | None = None
        self._files = self._make_files()

    @abstractmethod
    def _make_files(self) -> RemoteFiles:
        """The object that moves this host's files (it may keep this transport to run
        commands and reach the connection: it is built last, and opens nothing)."""

    # --- the host ---------------------------------------------------------------------------

    @property
    def home(self) -> str:
        return self.remote_path(self._home)

    @property
    def python(self) -> str:
        return self._python

    @property
    def address(self) -> str:
        """The HostName ssh_config resolved the host to."""
        return self.target.hostname

    @property
    def bind_address(self) -> str:
        return "0.0.0.0"

    @property
    def shares_files(self) -> bool:
        return False

    def listen_port(self, preferred: int | None = None) -> int:
        if preferred is not None:
            return preferred
        result = self.run([self.python, "-c", FREE_PORT_PY], timeout=self.connect_timeout * 4)
        try:
            return int(result.stdout.strip())
        except ValueError as exc:
            raise TransportError(f"cannot find a free port: {result}", host=self.name) from exc

    def known_hosts_files(self, explicit: str | None) -> tuple[str, ...]:
        """The user's known_hosts files, the first the one written: `explicit` alone when
        given, else ssh_config's UserKnownHostsFile (or ~/.ssh/known_hosts)."""
        if explicit:
            return (explicit,)
        return tuple(self.target.known_hosts_files or (default_known_hosts(),))

    def global_known_hosts_files(self) -> tuple[str, ...]:
        """ssh_config's GlobalKnownHostsFile, or the system's."""
        return tuple(self.target.global_known_hosts_files or (GLOBAL_KNOWN_HOSTS,))

    # --- paths and files --------------------------------------------------------------------

    def remote_path(self, path: str) -> str:
        """`path` made absolute on the host: `~` and `~/x` expand to the remote home,
        relative paths are taken from the home directory (as ssh and sftp do)."""
        return home_relative(path, self._home_dir, self.name)

    def _home_dir(self) -> str:
        if self._remote_home is None:
            self._remote_home = self._files.home()
        return self._remote_home

    def upload_tree(self, local_dir: str, remote_dir: str,
                    exclude: Sequence[str] = DEFAULT_EXCLUDES,
                    progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        if not Path(local_dir).is_dir():
            raise TransportError(f"cannot upload {local_dir}: not a directory", host=self.name)
        return self._files.upload_tree(local_dir, self.remote_path(remote_dir), exclude,
                                       progress)

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o644) -> None:
        self._files.write(data, self.remote_path(remote), mode)

    def put(self, local: str, remote: str, *, mode: int | None = None) -> None:
        self._files.put(local, self.remote_path(remote), mode)

    def get(self, remote: str, local: str) -> None:
        self._files.get(self.remote_path(remote), local)

    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        return self._files.read_tail(self.remote_path(remote), offset, max_bytes)

    def makedirs(self, remote: str, *, mode: int = 0o700) -> None:
        self._files.makedirs(self.remote_path(remote), mode)

    def exists(self, remote: str) -> bool:
        return self._files.exists(self.remote_path(remote))
