"""The transport kinds by name: the one place a connection's kind is routed.

`conn_from_data` reads what the state store keeps (any kind, as every version of nebula wrote
it); `describe` makes the description of a spec's host for the cluster's `transport:`. A kind a
spec may name (as `openssh`: the user's own `ssh` over a master connection) is one package,
`nebula_cli/transport/<kind>/` (`conn.py`: its `Conn`, `CONN`, with `from_spec`; the
`Transport` it opens, `transport.py`), plus its line in `PACKAGES`; the kind of a scheduler's
nodes (`slurm-node`) is its package's `node_conn.CONN` (`nebula_cli.schedulers.registry`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from nebula_cli.errors import UsageError
from nebula_cli.schedulers.registry import parts
from nebula_cli.transport.conn import Conn

PACKAGES = ["nebula_cli.transport.local", "nebula_cli.transport.ssh",
            "nebula_cli.transport.openssh"]
"""The packages of the kinds a spec's `transport:` names, in the spec's order."""
SPEC_KINDS: dict[str, type[Conn]] = {
    cls.kind: cls for cls in (importlib.import_module(f"{p}.conn").CONN for p in PACKAGES)}
"""The kinds a spec's `transport:` names (each has `from_spec`)."""
KINDS: dict[str, type[Conn]] = {
    **SPEC_KINDS,
    **{m.CONN.kind: m.CONN for m in parts("node_conn")},
}
"""Every kind, by the name its data carries under ``"transport"``."""


def _unavailable(kind: object) -> UsageError:
    return UsageError(f"transport '{kind}' is not available in this version of nebula")


def conn_from_data(data: Mapping[str, Any]) -> Conn:
    """The description that `Conn.to_data` (or an earlier version of nebula) stored."""
    kind = data.get("transport")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise _unavailable(kind)
    return cls.from_data(data, conn_from_data)


def describe(kind: str, *, name: str, home: str, host: str | None = None,
             user: str | None = None, port: int | None = None, key: str | None = None,
             jump: str | None = None, python: str) -> Conn:
    """How to reach a spec's host of a cluster whose `transport:` is `kind`. `home` is used by
    kinds whose hosts share this machine; remote hosts find their own."""
    cls = SPEC_KINDS.get(kind)
    if cls is None:
        raise _unavailable(kind)
    return cls.from_spec(name=name, home=home, host=host, user=user, port=port, key=key,
                         jump=jump, python=python)
