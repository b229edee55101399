"""A cluster's DeepSpeed world ends together: no rank is left waiting for one that is gone.

Inside a cluster the ranks of every host form one collective world. When a rank dies in the
middle of training, the others leave their collective at once (gloo and NCCL see the closed
connections). But a rank that dies *before* it has connected (an import error, a host whose
interface cannot reach the master) leaves the others waiting in the rendezvous for torch's
default timeout, 30 minutes, and a world whose rank died in a collective with no connection to
close can wait as long. The host agents cannot reach each other, but every rank can reach the
world's rendezvous store (the TCPStore that rank 0 serves at MASTER_ADDR:MASTER_PORT), and so
can the failing host's agent:

- the failing host's agent (unless it is the world's first host: its rank 0 served the store,
  and the others lose their connections to it) sets the world's abort key in that store, the
  reason as its value with the time the failure was seen (``python -m nebula_cli.runtime.
  worldwatch abort FAILED_AT REASON``, the world's address from the ranks' environment), before
  it ends its own ranks and restarts them or gives up;
- every rank of a world of two or more hosts watches the key from a daemon thread (started by
  the automatic hook when the script imports ``torch.distributed``, and by ``OuterSync``): once
  it is set by a failure seen after the rank started (:data:`STALE_S`), the rank prints the
  reason and exits with :data:`ABORT_EXIT`; its agent then sees a failure like any other and
  restarts its ranks with the others (``max_restarts``) or records the reason.

The watcher connects as one more client of the store (retrying until rank 0 serves it); it
reads one key every :data:`POLL_S` seconds, never writes, and stops quietly when the store goes
away (the world ended). A world of one host has nobody to tell and runs no watcher.

The store authenticates nobody (nor does gloo: the network inside a cluster is trusted), but an
abort is taken only from who holds the job's world secret (``$NEBULA_WORLD_SECRET``, from the
agents' agent.json, drawn at launch): the key's name is derived from it (:func:`abort_key`) and
its value carries an HMAC-SHA256 of the time and reason under it, checked before a rank
leaves. Anything else that reaches the store cannot end the world with one key; a value that
fails the check is ignored. Without a secret no watcher runs and no abort is sent.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import hmac
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping

from nebula_cli.config.parts import ABORT_EXIT, WORLD_SECRET_ENV

ABORT_PREFIX = "nebula/abort/"
POLL_S = 1.0
CONNECT_S = 5.0
EXIT_WAIT_S = 6 * CONNECT_S
"""How long the exit waits for a store call under way. A process must not finalize while the
watcher is inside torch's C++ (its return to Python then ends the process in std::terminate,
exit 134). torch's TCPStore client, connecting to a store that went away meanwhile, tries for
its timeout, backs off and tries once more (9-15 s seen, 14 s on CI); a store that stopped
answering (its host gone without a reset, its process frozen) blocks a call for good. After
this long the rank leaves without finalizing (:data:`STUCK_EXIT`), saying why."""
STUCK_EXIT = 1
"""Exit status of a rank whose script ended while the watcher was stuck in a store call."""
TELL_WITHIN = 60.0
"""How long the failed host's agent keeps trying to reach a store that nobody serves yet (a
rank that died at once, before rank 0 of a slower host started serving it)."""
STALE_S = 2.0
"""An abort that happened more than this before a rank started is not for it: a world restarted
after a failure (at least the agent's restart backoff, 5 s, later) may meet at the same
address before the failed host's agent has set its key, and must not be ended by it. Also the
clock difference between hosts that is tolerated."""


def _world(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(master address, port) of a world of two or more hosts; None otherwise."""
    try:
        nodes = int(env.get("NEBULA_NUM_NODES") or env.get("CROSS_SIZE") or 1)
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    return (addr, port) if nodes > 1 and addr else None


def _secret(env: Mapping[str, str]) -> bytes | None:
    secret = env.get(WORLD_SECRET_ENV)
    return secret.encode() if secret else None


def _mac(secret: bytes, text: str) -> str:
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def abort_key(secret: bytes) -> str:
    """The store key of the world's abort: named by the secret (not guessable without it)."""
    return ABORT_PREFIX + _mac(secret, "abort key")[:32]


def sealed(secret: bytes, failed_at: float, reason: str) -> bytes:
    """An abort's value: ``<time> <HMAC of time and reason> <reason>``."""
    at = f"{failed_at:.3f}"
    return f"{at} {_mac(secret, f'{at} {reason}')} {reason}".encode()


def opened(secret: bytes, value: bytes) -> tuple[float, str] | None:
    """(time, reason) of an abort's value, or None when it does not carry the secret's HMAC."""
    at, _, rest = value.decode(errors="replace").partition(" ")
    tag, _, reason = rest.partition(" ")
    if not hmac.compare_digest(tag, _mac(secret, f"{at} {reason}")):
        return None
    return _at(at), reason


def _store(addr: str, port: int, timeout: float):  # noqa: ANN202 - torch's TCPStore
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=False, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout))


class _Watch:
    started = False
    since = 0.0
    stop = threading.Event()
    busy = threading.Lock()
    """Held during every call into the store: at exit the interpreter waits for it, so that it
    never finalizes while the watcher is inside torch's C++ (std::terminate, exit 134)."""


def start(env: Mapping[str, str] | None = None) -> bool:
    """Watch this rank's world for an abort (once per process; only ranks of multi-host worlds,
    RANK and the world secret set). True when a watcher runs."""
    env = os.environ if env is None else env
    world, secret = _world(env), _secret(env)
    if _Watch.started or world is None or secret is None or "RANK" not in env:
        return _Watch.started
    _Watch.started = True
    _Watch.since = time.time()
    thread = threading.Thread(target=_watch, args=(*world, secret), name="nebula-worldwatch",
                              daemon=True)
    thread.start()
    atexit.register(_at_exit)
    return True


def _at_exit() -> None:
    """Registered when the watch starts, so after the script's own exit handlers (the automatic
    hook's last round runs watched): no new store call; wait (bounded) for the one under way."""
    _Watch.stop.set()
    if _Watch.busy.acquire(timeout=EXIT_WAIT_S):
        _Watch.busy.release()
        return
    print(f"nebula: the world's store did not answer for {EXIT_WAIT_S:.0f} s at exit; leaving "
          f"without waiting for it (exit {STUCK_EXIT})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(STUCK_EXIT)


def _serving(addr: str, port: int) -> bool:
    """Whether something accepts connections at the store's address (checked in Python, so that
    the watcher enters torch only when the store is there)."""
    try:
        socket.create_connection((addr, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _watch(addr: str, port: int, secret: bytes) -> None:
    key = abort_key(secret)
    store = None
    while store is None and not _Watch.stop.wait(POLL_S):
        if not _serving(addr, port):
            continue
        with _Watch.busy:
            if _Watch.stop.is_set():
                return
            try:
                store = _store(addr, port, CONNECT_S)
            except Exception:  # not the store yet, or no more: try again
                store = None
    while store is not None and not _Watch.stop.wait(POLL_S):
        with _Watch.busy:
            if _Watch.stop.is_set():
                return
            try:
                if not store.check([key]):
                    continue
                told = opened(secret, store.get(key))
            except Exception:  # the store went away: the world has ended
                return
        if told is None:
            continue  # not from a holder of the world's secret
        at, reason = told
        if at < _Watch.since - STALE_S:
            continue  # an earlier world's failure
        print(f"nebula: leaving the cluster's world: {reason}", file=sys.stderr, flush=True)
        os._exit(ABORT_EXIT)


def abort(reason: str, env: Mapping[str, str] | None = None, *, within: float = 0.0,
          failed_at: float | None = None) -> bool:
    """Tell every rank of this environment's world to leave (``failed_at``: when the failure
    was seen, time.time(); default now), trying for ``within`` seconds while nothing serves the
    store yet (rank 0 may still be starting). False when there is no world of several hosts or
    no world secret, or its store could not be reached (rank 0 gone: the others see that
    anyway)."""
    env = os.environ if env is None else env
    world, secret = _world(env), _secret(env)
    if world is None or secret is None:
        return False
    value = sealed(secret, failed_at or time.time(), reason)
    deadline = time.monotonic() + within
    while True:
        if _serving(*world):  # (no torch import while nobody serves it)
            try:
                _store(*world, CONNECT_S).set(abort_key(secret), value)
                return True
            except Exception:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _at(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    """``python -m nebula_cli.runtime.worldwatch abort FAILED_AT REASON``: exit 0 when told, 1
    if not (FAILED_AT: when the failure was seen, seconds since the epoch)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "abort" or not _at(args[1]):
        print("usage: python -m nebula_cli.runtime.worldwatch abort FAILED_AT REASON",
              file=sys.stderr)
        return 2
    return 0 if abort(args[2], failed_at=_at(args[1]), within=TELL_WITHIN) else 1


if __name__ == "__main__":
    raise SystemExit(main())
