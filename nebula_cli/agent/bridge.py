"""A tunnel key's forced command: one SSH session's stdin and stdout joined to a relay's port.

    python -m nebula_cli.agent.bridge [--seen FILE] 127.0.0.1:29400 [MORE ALLOWED TARGETS...]

sshd runs it (authorized_keys' ``command=``, see `nebula_cli.agent.grants`) in place of whatever
the key's holder asked for, so the key can reach the listed ports and nothing else: it is granted
no forwarding at all (no ``-L``, ``-R``, ``-W`` or Unix-socket forwarding, which
``permitopen``/``permitlisten`` cannot hold: OpenSSH has no list for Unix sockets). The dialling
side (`nebula_cli.agent.tunnel`) runs one ``ssh HOST TARGET`` per connection with that
connection as ssh's stdin and stdout; sshd hands TARGET over in SSH_ORIGINAL_COMMAND and it is
dialled only when it is one of the allowed targets (none asked: the first). Bytes are copied
both ways until both directions have ended (an EOF on stdin is passed on as a half close).
With ``--seen FILE``, the first session that asks for an allowed target writes the address it
came from, as sshd saw it (SSH_CONNECTION), into FILE (created, never replaced), from which the
relay pins the key to that address (`nebula_cli.agent.grants`).

Messages go to stderr, which ssh shows the dialler (its tunnel log). Standard library only: it
runs on hosts, under the account's login shell, with nebula's directory on PYTHONPATH.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

CHUNK = 1 << 16
CONNECT_TIMEOUT = 10.0


def say(message: str) -> None:
    print(f"nebula-bridge: {message}", file=sys.stderr, flush=True)


def choose(allowed: list[str], asked: str) -> str | None:
    """The target to dial: `asked` when allowed (nothing asked: the first allowed), else None."""
    asked = asked.strip()
    if not asked:
        return allowed[0] if allowed else None
    return asked if asked in allowed else None


def split(target: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = target.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _upstream(sock: socket.socket) -> None:
    """stdin into the socket; its end passed on as a half close."""
    try:
        while data := os.read(0, CHUNK):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def join(sock: socket.socket) -> None:
    """Copy both ways until the target ends its side (stdin may still be open then)."""
    threading.Thread(target=_upstream, args=(sock,), daemon=True).start()
    while data := sock.recv(CHUNK):
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]


def note_source(path: str) -> None:
    """Write this session's source address (SSH_CONNECTION's first word) into `path` unless a
    session wrote it before."""
    words = os.environ.get("SSH_CONNECTION", "").split()
    if not words:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        say(f"cannot note this session's address in {path}: {exc}")
        return
    with os.fdopen(fd, "w") as f:
        f.write(words[0][:100] + "\n")


def main(argv: list[str] | None = None) -> int:
    allowed = list(sys.argv[1:] if argv is None else argv)
    seen = None
    if allowed[:1] == ["--seen"] and len(allowed) >= 2:
        seen, allowed = allowed[1], allowed[2:]
    asked = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    target = choose(allowed, asked)
    if target is None:
        say(f"{asked.strip()[:100]!r} is not a target this key may reach "
            f"(allowed: {', '.join(allowed) or 'none'})")
        return 2
    if seen is not None:
        note_source(seen)
    try:
        sock = socket.create_connection(split(target), timeout=CONNECT_TIMEOUT)
    except (OSError, ValueError) as exc:
        say(f"cannot reach {target} from this host: {exc}")
        return 1
    sock.settimeout(None)
    try:
        join(sock)
    except OSError as exc:
        say(f"connection to {target} ended: {exc}")
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
