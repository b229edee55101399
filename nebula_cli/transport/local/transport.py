"""LocalTransport: every "host" is a set of process groups on this machine.

Files are written to a temporary name created 0600 (mkstemp), given their mode and renamed
over: never readable by others before their mode says so. Directories nebula makes are 0700,
parents included."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from nebula_cli.errors import TransportError
from nebula_cli.transport import tree
from nebula_cli.transport.base import (
    DEFAULT_TIMEOUT,
    CommandResult,
    LineSplitter,
    OutputSink,
    Transport,
    shell_join,
)
from nebula_cli.transport.freeport import free_port
from nebula_cli.transport.tree import DEFAULT_EXCLUDES

DEFAULT_PYTHON = "python3"
DIR_MODE = 0o700
"""Directories nebula makes: only the user's."""


def make_dirs(path: Path, mode: int = DIR_MODE) -> None:
    """Make `path` and every missing parent with `mode` (pathlib's and os.makedirs' parents
    get the default mode)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise
"""The spec's default `python`; on this machine it means the interpreter nebula runs under."""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a command's session (it and what it started), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def local_python(python: str | None) -> str:
    """The interpreter local processes run under: sys.executable unless one is named."""
    return sys.executable if python in (None, DEFAULT_PYTHON) else python


class LocalTransport(Transport):
    """Runs commands as subprocesses of this machine; files are plain file operations."""

    def __init__(self, name: str, *, home: str, python: str | None = None) -> None:
        self.name = name
        self._home = str(Path(home).expanduser())
        self._python = local_python(python)
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()

    @property
    def home(self) -> str:
        return self._home

    @property
    def python(self) -> str:
        return self._python

    @property
    def address(self) -> str:
        return "127.0.0.1"

    @property
    def bind_address(self) -> str:
        return "127.0.0.1"

    @property
    def shares_files(self) -> bool:
        return True

    def listen_port(self, preferred: int | None = None) -> int:
        """Always a free port: the "hosts" of local clusters share this machine's ports."""
        return free_port("127.0.0.1")

    def upload_tree(self, local_dir: str, remote_dir: str,
                    exclude: Sequence[str] = DEFAULT_EXCLUDES,
                    progress: Callable[[int, int], None] | None = None) -> tuple[int, int]:
        src, dst = Path(local_dir).resolve(), Path(remote_dir).expanduser().resolve()
        if not src.is_dir():
            raise TransportError(f"cannot upload {local_dir}: not a directory", host=self.name)
        self.check_open()
        if src == dst:
            return 0, 0  # already there
        dirs, files = tree.walk(src, exclude)
        for rel_dir in dirs:
            make_dirs(dst / rel_dir)
        todo = []
        for item in files:
            try:
                st = os.stat(dst / item.rel)
                if tree.unchanged(item, st.st_size, st.st_mtime):
                    continue
            except FileNotFoundError:
                pass
            todo.append(item)
        total, done = sum(item.size for item in todo), 0
        for item in todo:
            self.check_open()
            target = dst / item.rel
            tmp = target.with_name(f".{target.name}.nebula-tmp")
            try:
                shutil.copyfile(item.path, tmp)
                os.chmod(tmp, item.mode)
                os.utime(tmp, (item.mtime, item.mtime))
                os.replace(tmp, target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise TransportError(f"cannot copy {item.path} to {target}: {exc}",
                                     host=self.name) from exc
            done += item.size
            if progress is not None:
                progress(done, total)
        if progress is not None:
            progress(done, total)
        return len(todo), done

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
        """Each command runs in a session of its own, so that `close()` (or a timeout) ends it
        with everything it started."""
        command = shell_join(argv)
        self.check_open()
        try:
            proc = subprocess.Popen(
                argv, shell=isinstance(argv, str), env={**os.environ, **(env or {})}, cwd=cwd,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise TransportError(f"cannot run `{command}`: {exc}", host=self.name) from exc
        with self._lock:
            self._live.add(proc)
        if self.aborted:  # aborted while it started: end it with the others
            _kill(proc)
        sinks: list[list[bytes]] = [[], []]
        splitter = LineSplitter(on_output) if on_output is not None else None

        def drain(pipe: IO[bytes], sink: list[bytes]) -> None:
            while data := pipe.read1(1 << 16):  # type: ignore[attr-defined]
                sink.append(data)
                if splitter is not None:
                    splitter.feed(data)

        readers = [threading.Thread(target=drain, args=(pipe, sink), daemon=True)
                   for pipe, sink in zip((proc.stdout, proc.stderr), sinks, strict=True)]
        for reader in readers:
            reader.start()
        try:
            if stdin is not None and proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.write(stdin)
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            _kill(proc)
            raise TransportError(f"`{command}` did not finish within {timeout:g} s",
                                 host=self.name) from exc
        finally:
            with self._lock:
                self._live.discard(proc)
            for reader in readers:
                reader.join(5)
            if splitter is not None:
                splitter.close()
        return CommandResult(
            command=command, exit_code=proc.returncode,
            stdout=b"".join(sinks[0]).decode(errors="replace"),
            stderr=b"".join(sinks[1]).decode(errors="replace"),
        )

    def close(self) -> None:
        """End every command still running (and what it started)."""
        with self._lock:
            live, self._live = list(self._live), set()
        for proc in live:
            _kill(proc)

    def put_bytes(self, data: bytes, remote: str, *, mode: int = 0o644) -> None:
        target = Path(remote)
        make_dirs(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put(self, local: str, remote: str, *, mode: int | None = None) -> None:
        try:
            with open(local, "rb") as src:
                data = src.read()
                file_mode = mode if mode is not None else os.fstat(src.fileno()).st_mode & 0o7777
            self.put_bytes(data, remote, mode=file_mode)
        except OSError as exc:
            raise TransportError(f"cannot copy {local} to {remote}: {exc}", host=self.name) from exc

    def get(self, remote: str, local: str) -> None:
        try:
            shutil.copyfile(remote, local)
        except OSError as exc:
            raise TransportError(f"cannot copy {remote} to {local}: {exc}", host=self.name) from exc

    def read_tail(self, remote: str, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        try:
            with open(remote, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < offset:
                    offset = 0
                fh.seek(offset)
                data = fh.read(max_bytes)
        except FileNotFoundError:
            return b"", offset
        except OSError as exc:
            raise TransportError(f"cannot read {remote}: {exc}", host=self.name) from exc
        return data, offset + len(data)

    def makedirs(self, remote: str, *, mode: int = DIR_MODE) -> None:
        make_dirs(Path(remote), mode)

    def exists(self, remote: str) -> bool:
        return os.path.exists(remote)
