"""`LocalConn`: this machine; it opens a `LocalTransport` that runs commands here."""

from __future__ import annotations

import sys
from pathlib import Path

from nebula_cli.transport import LocalTransport
from nebula_cli.transport.local.conn import LocalConn
from nebula_cli.transport.registry import conn_from_data


def test_it_opens_a_transport_that_runs_here(tmp_path: Path) -> None:
    conn = LocalConn.from_spec(name="e1", home=str(tmp_path), python="python3")
    assert conn.python == sys.executable  # the spec's default: this interpreter
    t = conn.open()
    assert isinstance(t, LocalTransport) and t.home == str(tmp_path)
    result = t.run([t.python, "-c", "import sys; print(sys.executable)"], timeout=60)
    assert result.ok and result.stdout.strip() == sys.executable


def test_a_named_interpreter_is_kept() -> None:
    conn = LocalConn.from_spec(name="e1", home="/h", python="/opt/py/bin/python3")
    assert conn.python == "/opt/py/bin/python3" and conn.open().python == "/opt/py/bin/python3"


def test_its_data_names_no_pythonpath_unless_set() -> None:
    conn = LocalConn(name="e1", home="/h", python="python3")
    assert conn.to_data() == {"transport": "local", "name": "e1", "home": "/h",
                              "python": "python3"}
    assert conn_from_data({**conn.to_data(), "pythonpath": "/l"}) == conn.with_pythonpath("/l")
