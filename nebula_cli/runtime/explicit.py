"""Which engines a training script syncs itself through the explicit API: every ``OuterSync``
notes its engine here, and the automatic hook (``runtime.engine``) stands aside for an engine
that an OuterSync other than its own was built on, so that the two never both sync.

Standard library only; imported by ``runtime.sync``."""

from __future__ import annotations

import weakref
from typing import Any

_syncs: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_by_id: dict[int, Any] = {}  # engines that cannot be weakly referenced


def note_outer_sync(engine: Any, sync: Any) -> None:
    """Record that ``sync`` (an OuterSync) was built on ``engine`` (the latest one wins)."""
    try:
        _syncs[engine] = sync
    except TypeError:
        _by_id[id(engine)] = sync


def outer_sync_of(engine: Any) -> Any:
    """The latest OuterSync built on ``engine``, or None."""
    try:
        return _syncs.get(engine)
    except TypeError:
        return _by_id.get(id(engine))
