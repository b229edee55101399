"""The relay's status file and metrics lines, written by one thread.

``status_file`` (JSON, atomic rename) is rewritten after each round and whenever something
changed (a peer, an event); ``metrics_file`` gets one JSON line per round, rotated as the
agent says (``$NEBULA_ROTATION``, `config.rotation`). Other threads only
record what happened (:meth:`Status.event`, :meth:`Status.record_round`, :meth:`Status.touch`);
the writer thread turns it into files.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_cli.config.rotation import Rotation, append
from nebula_cli.relay.protocol.results import RoundOutcome

log = logging.getLogger("nebula.relay")

FLUSH_WAIT = 5.0
"""Longest wait of a round for its status and metrics line to be written."""
View = Callable[[], dict[str, Any]]
"""The relay's current view for the status: round, peers, bytes, refusals."""


class Status:
    """Counters of rounds and events, and the thread that writes them out."""

    def __init__(self, status_file: str | None, metrics_file: str | None, view: View) -> None:
        self.status_file, self.metrics_file, self._view = status_file, metrics_file, view
        self._rotation = Rotation.from_env()  # what the agent set: metrics_file stays bounded
        self.stats = {"rounds": 0, "events": 0, "missed": 0, "rejected": 0, "partial_rounds": 0}
        self.last: dict[str, Any] = {}
        self._lines: list[dict[str, Any]] = []
        self._dirty = True
        self._final: str | None = None
        self._queued = self._written = 0  # generations: records made, records on disk
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._write_loop, name="relay-status",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write the final status ("stopped") and end the writer."""
        with self._cv:
            self._final = "stopped"
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        else:
            self._write_status("stopped")

    def touch(self) -> None:
        with self._cv:
            self._dirty = True
            self._cv.notify_all()

    def event(self, msg: str, *args: Any) -> None:
        """Something a user should hear about (a warning, counted in the status)."""
        with self._cv:
            self.stats["events"] += 1
        log.warning(msg, *args)
        self.touch()

    def record_round(self, r: int, out: RoundOutcome, clusters: int, wan: tuple[int, int]) -> None:
        sent, recv = wan
        with self._cv:
            self.stats["rounds"] += 1
            self.stats["missed"] += bool(out.missing)
            self.stats["rejected"] += len(out.rejected)
            self.stats["partial_rounds"] += len(out.present) < clusters
            self.last = {"round": out.round_id, "round_s": round(out.seconds, 4),
                         "present": out.present, "missing": out.missing,
                         "rejected": out.rejected, "mode": out.mode}
            self._lines.append({
                "ts": time.time(), "round": out.round_id, "request_round": r,
                "round_s": round(out.seconds, 4), "bytes_sent": out.bytes_sent,
                "bytes_received": out.bytes_received, "bytes_sent_total": sent,
                "bytes_received_total": recv, "present": out.present, "missing": out.missing,
                "rejected": out.rejected, "mode": out.mode,
                "caught_up": out.global_state is not None, "weights": out.weights,
                "next_h": out.next.h, "next_h_why": out.next.why or None,
                "codec": out.codec or None, "next_codec": out.next.codec or None,
                "next_merge": out.next.merge})
            self._dirty = True
            self._queued += 1
            gen = self._queued
            self._cv.notify_all()
            if self._thread.is_alive():  # the worker hears of the round once it is on disk
                self._cv.wait_for(lambda: self._written >= gen or self._final, FLUSH_WAIT)

    def snapshot(self, state: str = "running") -> dict[str, Any]:
        with self._cv:
            stats, last = dict(self.stats), dict(self.last)
        return {**self._view(), "pid": os.getpid(), "state": state, "ts": time.time(),
                "last_round_s": last.get("round_s"), "present": last.get("present"),
                "missing": last.get("missing"), "rejected": last.get("rejected"), **stats}

    # ------------------------------------------------------------------ the writer

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._dirty or self._lines or self._final, 1.0)
                lines, self._lines = self._lines, []
                final, self._dirty, gen = self._final, False, self._queued
            self._append(lines)
            self._write_status(final or "running")
            with self._cv:
                self._written = gen
                self._cv.notify_all()
            if final:
                return

    def _append(self, lines: list[dict[str, Any]]) -> None:
        if not self.metrics_file or not lines:
            return
        cluster = self._view().get("cluster")
        data = "".join(json.dumps({"cluster": cluster, **rec}) + "\n" for rec in lines)
        try:
            append(self.metrics_file, data.encode(), self._rotation)
        except OSError as exc:
            log.warning("cannot append to metrics file %s: %s", self.metrics_file, exc)

    def _write_status(self, state: str) -> None:
        if not self.status_file:
            return
        try:
            atomic_write(Path(self.status_file), json.dumps(self.snapshot(state)) + "\n")
        except OSError as exc:
            log.warning("cannot write status file %s: %s", self.status_file, exc)


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
