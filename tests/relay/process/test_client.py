"""relay/process/client.py: closing a RelayClient wakes a call another thread waits in (rank 0's
final state, which a stop gave up on) and ends it without reconnecting. A real relay on
loopback whose only peer never came: it would wait for that peer for minutes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from helpers.relays import Job, running

from nebula_cli.relay.process.client import RelayError


def test_close_ends_a_final_state_wait_at_once_without_reconnecting(tmp_path: Path) -> None:
    job = Job(tmp_path, ["a", "b"])
    with running(job, ["a"]) as relays:
        client = job.client("a")  # would retry a lost connection for 20 s
        out: dict[str, object] = {}

        def wait() -> None:
            try:
                out["answer"] = client.final_state(None)
            except RelayError as exc:
                out["error"] = str(exc)

        asking = threading.Thread(target=wait, daemon=True)
        asking.start()
        deadline = time.monotonic() + 20
        while relays["a"].rounds.state.finished is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the relay holds the question: cluster a finished, b never came
        assert relays["a"].rounds.state.finished is not None
        t0 = time.monotonic()
        client.close()
        asking.join(10)
        assert not asking.is_alive()
        assert time.monotonic() - t0 < 3.0
        assert out == {"error": "final_state: the relay client was closed"}
        client.close()  # twice: nothing happens
