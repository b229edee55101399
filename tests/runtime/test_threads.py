"""runtime/threads.py: work runs in a daemon thread, or in place where the interpreter refuses
a new thread (Python 3.12's atexit)."""

from __future__ import annotations

import threading

import pytest

from nebula_cli.runtime.threads import start_or_run


def test_a_daemon_thread_when_one_can_be_had() -> None:
    ran: list[str] = []
    thread = start_or_run(lambda: ran.append(threading.current_thread().name), (), "t-1")
    assert thread is not None and thread.daemon
    thread.join(10)
    assert ran == ["t-1"]


def test_in_place_when_none_can_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    ran: list[str] = []
    assert start_or_run(lambda x: ran.append(x), ("here",), "t-2") is None
    assert ran == ["here"]
