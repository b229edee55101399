"""Transport: how a command or a file reaches one host. One interface, two implementations.

Results are plain data; a failed command raises `CommandFailed` carrying its result only when
the caller asks (`check=True`). Implementations translate their backend's errors into
`TransportError` at this boundary.
"""

from __future__ import annotations

import posixpath
import shlex
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nebula_cli.errors import CommandFailed, TransportError
from nebula_cli.transport.routes import ROUTE_PY, parse_route

DEFAULT_TIMEOUT = 120.0


@dataclass(frozen=True)
class CommandResult:
    """What a finished command left behind."""

    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def tail(self, lines: int = 10) -> str:
        text = (self.stderr.strip() or self.stdout.strip()).splitlines()
        return "\n".join(text[-lines:])

    def __str__(self) -> str:
        tail = self.tail(5)
        return f"`{self.command}` exited {self.exit_code}" + (f":\n{tail}" if tail else "")


OutputSink = Callable[[str], None]  # called with each line of output as it arrives


class LineSplitter:
    """Bytes in, complete lines out to `sink` (thread-safe; `close` flushes a last partial)."""

    def __init__(self, sink: OutputSink) -> None:
        self.sink = sink
        self._buf = b""
        self._lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self._lock:
            *lines, self._buf = (self._buf + data).split(b"\n")
        for line in lines:
            self.sink(line.decode(errors="replace").rstrip("\r"))

    def close(self) -> None:
        with self._lock:
            rest, self._buf = self._buf, b""
        if rest:
            self.sink(rest.decode(errors="replace"))


def shell_join(argv: Sequence[str] | str) -> str:
    """A shell command line from an argv list (a string is taken as already a command line)."""
    return argv if isinstance(argv, str) else shlex.join(argv)


def home_relative(path: str, home: Callable[[], str], host: str) -> str:
    """`path` made absolute on a remote host: `~` and `~/x` expand to its home (`home()`, asked
    only when needed), relative paths are taken from the home (as ssh and sftp do)."""
    if path.startswith("/"):
        return path
    if path in ("~", ""):
        return home()
    if path.startswith("~/"):
        path = path[2:]
    elif path.startswith("~"):
        raise TransportError(f"cannot expand {path!r}: only ~/ paths are supported", host=host)
    return posixpath.normpath(posixpath.join(home(), path))


class Transport(ABC):
    """A connection to one host. Opens lazily, `close()` is idempotent, usable as `with`."""

    #: name shown to users (the spec's host entry)
    name: str

    @property
    @abstractmethod
    def home(self) -> str:
        """Absolute path of nebula's directory on the host (remote jobs live in home/jobs)."""

    @property
    @abstractmethod
    def python(self) -> str:
        """The Python interpreter on the host that has nebula_cli importable."""

    @property
    @abstractmethod
    def address(self) -> str:
        """The address other hosts use to reach this one."""

    @property
    @abstractmethod
    def bind_address(self) -> str:
        """The address a service on this host listens on, so that its peers reach it."""

    @property
    @abstractmethod
    def shares_files(self) -> bool:
        """Whether the host sees this machine's files at the same paths (nothing to upload)."""

    @abstractmethod
    def listen_port(self, preferred: int | None = None) -> int:
        """A port for a service on this host: `preferred` where hosts are machines of their
        own (a fixed port that firewalls can allow), else one found free there."""

    @abstractmethod
    def upload_tree(self, local_dir: str, remote_dir: str, exclude: Sequence[str] = (),
                    progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        """Copy a directory tree to the host, skipping files whose copy there has the same size
        and mtime. `exclude`: fnmatch patterns (see `tree.walk`). Files there that are not
        here are left alone. `progress(bytes_done, bytes_to_copy)` as data goes.
        Returns (files copied, bytes copied)."""

    @abstractmethod
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
        """Run a command to completion and capture its output (stdout and stderr drained);
        `on_output` also gets each line as it arrives (for streaming a long command)."""

    def run_detached(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                     cwd: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        """Run a command that leaves a process running after it returns (the agent's `start`,
        which daemonizes), where that process may outlive the command: here, as `run`."""
        return self.run(argv, env=env, cwd=cwd, timeout=timeout)

    @abstractmethod
    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o644) -> None:
        """Write bytes to a file on the host (parent directories made), atomically."""

    @abstractmethod
    def put(self, local: str, remote: str, *, mode: int | None = None) -> None:
        """Copy a local file to the host."""

    @abstractmethod
    def get(self, remote: str, local: str) -> None:
        """Copy a file from the host to this machine."""

    @abstractmethod
    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        """Bytes of a file from `offset` (at most max_bytes) and the offset after them.

        A missing file reads as empty. A file shorter than `offset` (truncated or replaced)
        is read from its start."""

    @abstractmethod
    def makedirs(self, remote: str, *, mode: int = 0o700) -> None:
        """Make a directory and its parents on the host (those made: `mode`, only the user's
        by default)."""

    def read_file(self, remote: str, max_bytes: int = 16 << 20) -> bytes | None:
        """A whole (small) file, or None when it does not exist."""
        data, _ = self.read_tail(remote, 0, max_bytes)
        return data if data or self.exists(remote) else None

    @abstractmethod
    def exists(self, remote: str) -> bool:
        """Whether a path exists on the host."""

    def ssh_login(self) -> tuple[str, int, str] | None:
        """(user, port, "<key type> <base64>") of the host's sshd as this transport reached
        and verified it, for SSH tunnels other hosts open to it; None when not over SSH."""
        return None

    def reached_as(self) -> str | None:
        """How this host was reached, for `validate --hosts` (where, through what, the
        config lines and the authentication used); None where there is nothing to say."""
        return None

    def route_interface(self, address: str) -> str:
        """The network interface this host reaches `address` through (see `routes`)."""
        result = self.run([self.python, "-c", ROUTE_PY, address], timeout=60)
        if not result.ok:
            raise TransportError(f"cannot tell which interface reaches {address}: {result}",
                                 host=self.name)
        return parse_route(result.stdout, self.name, address)

    def run_checked(self, argv: Sequence[str] | str, **kwargs: object) -> CommandResult:
        """`run`, raising CommandFailed (with the result) on a non-zero exit."""
        result = self.run(argv, **kwargs)  # type: ignore[arg-type]
        if not result.ok:
            raise CommandFailed(result, host=self.name)
        return result

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Safe to call twice; a later operation opens them again."""

    aborted = False
    """Set by `abort`: every later operation raises TransportError."""

    def abort(self) -> None:
        """Close for good: what runs returns (with an error), nothing more starts. For
        cancelling work that other threads are doing through this transport."""
        self.aborted = True
        self.close()

    def check_open(self) -> None:
        """TransportError if this transport was aborted."""
        if self.aborted:
            raise TransportError("cancelled: the connection was closed", host=self.name)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
