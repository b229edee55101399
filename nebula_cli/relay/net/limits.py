"""What a relay lets others make it hold: every cap on memory, threads and connections that a
peer or a worker (even one with a valid certificate of the job) can drive, in one place.

The size of what a relay syncs (:class:`SyncSize`) is fixed by its workers' first
registration and stated to peers in HELLO and heartbeats; it caps every allocation made on a
peer's behalf (a chunk frame, a catch-up transfer, early chunks held before their round).
Before it is known nothing is allocated for a peer beyond a control frame.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nebula_cli.errors import NebulaError
from nebula_cli.relay.net.schema import is_int

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection may take, from accept, for its TLS handshake and HELLO (a deadline:
it is ended then, whatever it still trickles); its first byte must come within
`admission.FIRST_BYTES_TIMEOUT`."""
MAX_HANDSHAKES = 32
"""Connections of one listener between accept and the end of their hello; a new one beyond
them ends the oldest silent pending connection of the address holding the most in the network
holding the most (`admission`)."""
MAX_HANDSHAKES_PER_ADDRESS = 4
"""Of those, from one address (an IPv6 /64); a new one beyond them ends that address's oldest:
one flooding host crowds out only itself. Real peers dial one connection at a time."""
MAX_WORKER_CONNECTIONS = 8
"""Worker connections served at once (only a cluster's rank 0 talks to its relay)."""
WORKER_KEEPALIVE_IDLE = 30
"""Seconds of silence on a worker's connection before TCP keepalive probes start."""
MAX_REQUESTS_PER_LINK = 4
"""Result or state requests of one peer served at once; more are answered "busy"."""
CONTROL_PAYLOAD = 64 * 1024
"""Largest frame payload on a peer link while this relay's sync size is not known."""
CHUNK_SLACK = 4096
"""Bytes a chunk frame may carry beyond 4 bytes per element (codec headers)."""
MAX_ROUNDS_AHEAD = 2
"""Round-control messages and early chunks for rounds further beyond this relay's newest are
refused (a real peer is never more than one round ahead of a cluster it exchanges with)."""
EARLY_COPIES = 2
"""Early chunks held from one peer (all its rounds and attempts): at most this many fp32 copies
of the sync size. Each peer has its own budget: one peer's chunks never crowd out another's."""
EARLY_FRAME_COST = 512
"""What a held early frame counts beyond its payload and its meta (the objects holding it)."""
MAX_OPEN_ROUNDS = 32
"""Round-control state (decisions, behind notices) kept for this many rounds at most."""
MAX_SYNC_NUMEL = 1 << 34
"""Largest size a worker may register (fp32 elements)."""
REFUSAL_LOG_INTERVAL = 5.0
"""Seconds between two log lines about refusals of the same kind from the same source."""

log = logging.getLogger("nebula.relay")


class LimitExceeded(NebulaError):
    """A peer or worker asked for more than this relay holds for anybody (the message says
    who, what and the cap)."""


@dataclass(frozen=True)
class SyncSize:
    """What a cluster syncs: the tensors' count, shapes and dtypes (flat fp32 on the wire)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def tensors(self) -> int:
        return len(self.shapes)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @classmethod
    def flat(cls, numel: int) -> SyncSize:
        """One flat fp32 vector (a worker that registered by its first contribution)."""
        return cls(((numel,),), ("float32",))

    def to_meta(self) -> dict[str, Any]:
        """The size as stated to peers: element and tensor counts, the dtypes, and a digest
        of the shapes (a model of many tensors still fits a HELLO)."""
        shapes = json.dumps([list(s) for s in self.shapes], separators=(",", ":"))
        return {"numel": self.numel, "tensors": self.tensors,
                "dtypes": sorted(set(self.dtypes)),
                "shapes_sha256": hashlib.sha256(shapes.encode()).hexdigest()}

    def to_layout(self) -> dict[str, Any]:
        """The layout a worker states at HELLO (read back by :meth:`from_layout`)."""
        return {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes)}

    @classmethod
    def from_layout(cls, meta: Any) -> SyncSize:
        """A worker's layout {shapes: [[...], ...], dtypes: [...]}; LimitExceeded if malformed
        or too large."""
        try:
            shapes = tuple(tuple(_dim(d) for d in s) for s in meta["shapes"])
            dtypes = tuple(str(d) for d in meta["dtypes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LimitExceeded(f"malformed sync size {meta!r}") from exc
        if len(shapes) != len(dtypes) or len(shapes) > 1 << 20:
            raise LimitExceeded(f"sync size with {len(shapes)} shapes and {len(dtypes)} dtypes")
        size = cls(shapes, dtypes)
        if size.numel > MAX_SYNC_NUMEL:
            raise LimitExceeded(f"sync size of {size.numel} elements exceeds {MAX_SYNC_NUMEL}")
        return size


def _dim(d: Any) -> int:
    if not is_int(d) or not 0 <= d <= MAX_SYNC_NUMEL:
        raise ValueError(f"bad dimension {d!r}")
    return d


def chunk_payload_cap(chunk_elems: int, sync_numel: int | None) -> int:
    """Largest payload of a frame on a peer link: a control frame before the sync size is
    known, else one chunk (of at most the synced size) in fp32 plus codec headers."""
    if sync_numel is None:
        return CONTROL_PAYLOAD
    return max(CONTROL_PAYLOAD, 4 * min(chunk_elems, sync_numel) + CHUNK_SLACK)


class Gate:
    """At most ``total`` holders at once, ``per_key`` of them with one key (an address, a
    peer). ``enter`` says whether a slot was free; every successful ``enter`` needs ``leave``."""

    def __init__(self, total: int, per_key: int | None = None) -> None:
        self.total = total
        self.per_key = per_key or total
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, key: str) -> bool:
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held.get(key, 0) >= self.per_key:
                return False
            self._held[key] = self._held.get(key, 0) + 1
            return True

    def leave(self, key: str) -> None:
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    @property
    def held(self) -> int:
        with self._lock:
            return sum(self._held.values())


class Refusals:
    """Counts refusals per (kind, source) and logs them as warnings, at most one line per
    REFUSAL_LOG_INTERVAL for each (a flood makes a few lines that say how many)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}
        self._clock = clock
        self._lock = threading.Lock()

    def refuse(self, kind: str, who: str, detail: str) -> None:
        key = (kind, who)
        now = self._clock()
        with self._lock:
            n = self.counts[key] = self.counts.get(key, 0) + 1
            at, logged_n = self._logged.get(key, (-math.inf, 0))
            if now - at < REFUSAL_LOG_INTERVAL:
                return
            self._logged[key] = (now, n)
        more = f" ({n - logged_n} refused since the last line, {n} in all)" if n > 1 else ""
        log.warning("refused %s from %s: %s%s", kind, who, detail, more)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


def held_size(frame: Any) -> int:
    """Bytes a held frame stands for: payload, meta, and the objects around them."""
    meta = json.dumps(frame.meta, separators=(",", ":"), default=str)
    return len(frame.payload) + len(meta) + EARLY_FRAME_COST


class EarlyChunks:
    """Chunks that arrived before this relay started their round's exchange, held for it.

    Held only from senders and coordinators that are clusters of the job, for rounds in
    (done, done + MAX_ROUNDS_AHEAD], attempts below `max_attempts`, one per (round key, sender,
    chunk index) with an index the sync size allows; EARLY_COPIES x the sync size from each
    sender, every frame counted with its meta and EARLY_FRAME_COST on top of its payload (a
    zero-length chunk is not free). A sender that fills its budget (a peer gone wrong, or an
    attacker holding a certificate of the job) is refused alone: the others' chunks are still
    held, so the round goes on with them. Every check comes before anything is stored; anything
    else is refused (LimitExceeded says why). ``size(chunk)`` is what holding one costs (default
    :func:`held_size` of a frame)."""

    def __init__(self, clusters: Sequence[str], max_attempts: int,
                 size: Callable[[Any], int] = held_size) -> None:
        self._held: dict[tuple[int, int, str], dict[tuple[str, int], Any]] = {}
        self._clusters = frozenset(clusters)
        self._max_attempts = max_attempts
        self._size = size
        self._by_sender: dict[str, int] = {}  # bytes held per sender

    @property
    def bytes(self) -> int:
        """Bytes held, all senders."""
        return sum(self._by_sender.values())

    def add(self, key: tuple[int, int, str], src: str, k: Any, frame: Any, *, done: int,
            sync_numel: int | None, num_chunks: int) -> None:
        round_id, attempt, coord = key
        if sync_numel is None:
            raise LimitExceeded("a chunk before this cluster's workers registered")
        if src not in self._clusters:
            raise LimitExceeded(f"a chunk from {src!r}, not a cluster of this job")
        if not done < round_id <= done + MAX_ROUNDS_AHEAD:
            raise LimitExceeded(f"a chunk for round {round_id} (this relay is at round {done})")
        if not 0 <= attempt < self._max_attempts or coord not in self._clusters:
            raise LimitExceeded(f"a chunk for attempt {attempt} coordinated by {coord!r}")
        if not isinstance(k, int) or not 0 <= k < num_chunks:
            raise LimitExceeded(f"chunk index {k!r} (the sync size has {num_chunks} chunks)")
        size = self._size(frame)
        slot = self._held.get(key)
        if slot is not None and (src, k) in slot:
            raise LimitExceeded(f"chunk {k} of round {round_id} twice")
        theirs = self._by_sender.get(src, 0)
        if theirs + size > EARLY_COPIES * (4 * sync_numel + num_chunks * EARLY_FRAME_COST) \
                + CHUNK_SLACK:
            raise LimitExceeded(f"its early chunks beyond {EARLY_COPIES}x the sync size")
        self._held.setdefault(key, {})[(src, k)] = frame
        self._by_sender[src] = theirs + size

    def pop(self, key: tuple[int, int, str]) -> list[tuple[str, Any]]:
        slot = self._held.pop(key, {})
        for (src, _), f in slot.items():
            left = self._by_sender[src] - self._size(f)
            if left:
                self._by_sender[src] = left
            else:
                del self._by_sender[src]
        return [(src, f) for (src, _), f in slot.items()]

    def held_from(self, src: str) -> int:
        """Bytes held from ``src``."""
        return self._by_sender.get(src, 0)

    def drop_through(self, round_id: int) -> None:
        """Forget rounds up to ``round_id`` (done)."""
        for key in [k for k in self._held if k[0] <= round_id]:
            self.pop(key)

    def keys(self) -> Sequence[tuple[int, int, str]]:
        return list(self._held)
