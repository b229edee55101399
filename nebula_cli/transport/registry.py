"""The transport kinds by name: the one place a connection's kind is routed.

`conn_from_data` reads what the state store keeps (any kind, as every version of nebula wrote
it); `describe` makes the description of a spec's host for the cluster's `transport:`. A kind
(as `openssh_conn`: the user's own `ssh` over a master connection) is its `Conn` module (and
the `Transport` it opens) plus one line in `KINDS`, and in `SPEC_KINDS` when a spec may name
it; the kind of a scheduler's nodes (`slurm-node`) is its package's `node_conn.CONN`
(`nebula_cli.schedulers.registry`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nebula_cli.errors import UsageError
from nebula_cli.schedulers.registry import parts
from nebula_cli.transport.conn import Conn
from nebula_cli.transport.local_conn import LocalConn
from nebula_cli.transport.openssh_conn import OpensshConn
from nebula_cli.transport.ssh_conn import SshConn

SPEC_KINDS: dict[str, type[LocalConn] | type[SshConn] | type[OpensshConn]] = {
    LocalConn.kind: LocalConn,
    SshConn.kind: SshConn,
    OpensshConn.kind: OpensshConn,
}
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
