"""SftpFiles, the files of an SSHTransport: one SFTP session per connection, held exclusively;
uploads written to a temporary name and renamed over; paramiko's errors translated here. A host
whose sshd refuses the SFTP subsystem gets the same operations over exec channels
(`execfiles`). It takes absolute paths (the transport makes them) and is handed the transport's
connection and command runner, which it shares rather than inherits.

Files are created with their final mode (0600 for keys) and O_EXCL, never chmod-ed after a
window in which another user could open them; directories nebula makes are 0700 (DIR_MODE)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import posixpath
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

import paramiko
from paramiko.sftp import CMD_HANDLE, CMD_OPEN, SFTP_FLAG_CREATE, SFTP_FLAG_EXCL, SFTP_FLAG_WRITE

from nebula_cli.errors import TransportError
from nebula_cli.transport import tree
from nebula_cli.transport.base import DEFAULT_TIMEOUT
from nebula_cli.transport.execfiles import ExecFiles, Runner

SFTP_TIMEOUT = DEFAULT_TIMEOUT
CHUNK = 1 << 16
DIR_MODE = 0o700
"""Directories nebula makes on hosts: only the user's."""
log = logging.getLogger("nebula.transport")


class SftpFiles:
    """File operations over the SFTP session of `connection()` (see the module); absolute
    paths only."""

    def __init__(self, runner: Runner, connection: Callable[[], paramiko.Transport]) -> None:
        self.runner = runner
        self.name = runner.name
        self._connection = connection
        self._lock = threading.RLock()
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_conn: paramiko.Transport | None = None
        self._exec_files: ExecFiles | None = None

    def _over_exec(self) -> ExecFiles | None:
        """None while SFTP serves; the exec-channel fallback once the host refused SFTP (the
        connection stays up: a refusal, not a failure)."""
        if self._exec_files is not None or self._sftp is not None:
            return self._exec_files
        conn = self._connection()
        with self._lock:
            try:
                self._open_sftp(conn)
            except (EOFError, paramiko.SSHException) as exc:
                self._sftp = None
                if not conn.is_active():
                    raise TransportError(f"cannot open SFTP: {exc}", host=self.name) from exc
                log.warning("%s: the host's sshd has no SFTP subsystem (%s); files go over "
                            "exec channels (sh, cat, base64, tar) instead", self.name, exc)
                self._exec_files = ExecFiles(self.runner)
        return self._exec_files

    def _open_sftp(self, conn: paramiko.Transport) -> paramiko.SFTPClient:
        """Open the SFTP session on `conn` (with the lock held)."""
        self._sftp = paramiko.SFTPClient.from_transport(conn)
        if self._sftp is None:
            raise paramiko.SSHException("the server refused the sftp subsystem")
        self._sftp.get_channel().settimeout(SFTP_TIMEOUT)
        self._sftp_conn = conn
        return self._sftp

    def drop(self) -> paramiko.SFTPClient | None:
        """Forget the session (its connection is being dropped); returns it, for the caller to
        close with the connection."""
        sftp, self._sftp, self._sftp_conn = self._sftp, None, None
        return sftp

    @contextlib.contextmanager
    def _sftp_session(self, what: str) -> Iterator[paramiko.SFTPClient]:
        """The one SFTP session (opened on demand), held exclusively; errors translated."""
        conn = self._connection()
        with self._lock:
            try:
                if self._sftp is None or self._sftp_conn is not conn:
                    self._open_sftp(conn)
                yield self._sftp
            except (OSError, EOFError, paramiko.SSHException) as exc:
                detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise TransportError(f"cannot {what}: {detail or type(exc).__name__}",
                                     host=self.name) from exc

    def home(self) -> str:
        """The remote home directory."""
        if (x := self._over_exec()) is not None:
            return x.home()
        with self._sftp_session("find the remote home directory") as sftp:
            return sftp.normalize(".")

    def _upload(self, sftp: paramiko.SFTPClient, src: IO[bytes], path: str, mode: int,
                mtime: float | None = None, sent: Callable[[int], None] | None = None) -> int:
        """Write `src` to a temporary name next to `path`, set mode (before any data) and mtime,
        then rename it over `path`. Returns the bytes written."""
        parent, base = posixpath.split(path)
        tmp = posixpath.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.tmp")
        total = 0
        try:
            with _create(sftp, tmp, mode) as fh:
                fh.set_pipelined(True)
                fh.chmod(mode)  # exactly `mode` (the server's umask may have taken bits)
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

    def write(self, data: bytes, path: str, mode: int) -> None:
        if (x := self._over_exec()) is not None:
            return x.write(data, path, mode)
        with self._sftp_session(f"write {path}") as sftp:
            self._mkdirs(sftp, posixpath.dirname(path), DIR_MODE)
            self._upload(sftp, io.BytesIO(data), path, mode)

    def put(self, local: str, path: str, mode: int | None) -> None:
        if (x := self._over_exec()) is not None:
            return x.put(local, path, mode)
        try:
            src = open(local, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise TransportError(f"cannot copy {local} to {path}: {exc}", host=self.name) from exc
        with src, self._sftp_session(f"copy {local} to {path}") as sftp:
            self._mkdirs(sftp, posixpath.dirname(path), DIR_MODE)
            file_mode = mode if mode is not None else os.fstat(src.fileno()).st_mode & 0o7777
            self._upload(sftp, src, path, file_mode)

    def get(self, path: str, local: str) -> None:
        if (x := self._over_exec()) is not None:
            return x.get(path, local)
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

    def read_tail(self, path: str, offset: int, max_bytes: int) -> tuple[bytes, int]:
        if (x := self._over_exec()) is not None:
            return x.read_tail(path, offset, max_bytes)
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
                if want > CHUNK:
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

    def makedirs(self, path: str, mode: int) -> None:
        if (x := self._over_exec()) is not None:
            return x.makedirs(path, mode)
        with self._sftp_session(f"make directory {path}") as sftp:
            self._mkdirs(sftp, path, mode)

    def exists(self, path: str) -> bool:
        if (x := self._over_exec()) is not None:
            return x.exists(path)
        with self._sftp_session(f"check {path}") as sftp:
            try:
                sftp.stat(path)
            except (FileNotFoundError, PermissionError):
                return False
        return True

    def upload_tree(self, local_dir: str, base: str, exclude: Sequence[str],
                    progress: Callable[[int, int], None] | None) -> tuple[int, int]:
        """See `Transport.upload_tree`; copies get the local mtime (SFTP)."""
        if (x := self._over_exec()) is not None:
            return x.upload_tree(local_dir, base, exclude, progress)
        dirs, files = tree.walk(local_dir, exclude)
        by_dir: dict[str, list[tree.TreeFile]] = {}
        for item in files:
            by_dir.setdefault(posixpath.dirname(item.rel), []).append(item)
        with self._sftp_session(f"upload {local_dir} to {base}") as sftp:
            todo = []
            for rel_dir in dirs:
                rdir = posixpath.join(base, rel_dir) if rel_dir else base
                self._mkdirs(sftp, rdir, DIR_MODE)
                remote = {a.filename: a for a in sftp.listdir_attr(rdir)}
                for item in by_dir.get(rel_dir, []):
                    attr = remote.get(posixpath.basename(item.rel))
                    if (attr is not None and stat.S_ISREG(attr.st_mode or 0)
                            and tree.unchanged(item, attr.st_size, attr.st_mtime)):
                        continue
                    todo.append(item)
            total = sum(item.size for item in todo)
            done = 0

            def sent(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(done, total)

            for item in todo:
                with open(item.path, "rb") as src:
                    self._upload(sftp, src, posixpath.join(base, item.rel), item.mode,
                                 mtime=item.mtime, sent=sent)
        if progress is not None:
            progress(done, total)
        return len(todo), done


def _create(sftp: paramiko.SFTPClient, path: str, mode: int) -> paramiko.SFTPFile:
    """A new file opened for writing, created by the server with `mode` (O_CREAT | O_EXCL: never
    an existing file, nor through a symlink). paramiko's `open` sends no attributes, so the
    server would create the file with its default mode, readable by others until a chmod, and
    whoever opened it meanwhile keeps reading what is written; SFTP's OPEN carries the mode."""
    attrs = paramiko.SFTPAttributes()
    attrs.st_mode = mode & 0o7777
    t, msg = sftp._request(CMD_OPEN, sftp._adjust_cwd(path),
                           SFTP_FLAG_WRITE | SFTP_FLAG_CREATE | SFTP_FLAG_EXCL, attrs)
    if t != CMD_HANDLE:
        raise paramiko.SFTPError("Expected handle")
    return paramiko.SFTPFile(sftp, msg.get_binary(), "wb")
