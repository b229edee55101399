"""Several `Rounds` joined by an in-memory network (`FakeNet`, `Hub`: a delivery thread per relay),
`run_round`, and a relay config per cluster."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from helpers.plan_defaults import relay_defaults

from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.relay.codecs.registry import relay_codecs
from nebula_cli.relay.net.limits import (
    Refusals,
)
from nebula_cli.relay.net.wire import Frame, FrameType
from nebula_cli.relay.protocol.messages import FetchRequest, PeerChunk, ResultAsk, decode_round
from nebula_cli.relay.protocol.results import Average, GlobalState, RoundOutcome
from nebula_cli.relay.protocol.rounds import Rounds


class Hub:
    """In-memory network: frames to a relay are queued and handed to it by its own thread."""

    def __init__(self, clusters: list[str], **kw: Any) -> None:
        self.order = clusters
        self.up = set(clusters)
        self.left: set[str] = set()
        """Clusters whose relay said goodbye as it went (stopped, as by `leave`)."""
        self.events: dict[str, list[str]] = {c: [] for c in clusters}
        self.outcomes: dict[str, list[RoundOutcome]] = {c: [] for c in clusters}
        self.rounds = {
            c: Rounds(cfg := config(c, clusters, **kw),
                      relay_codecs(cfg), FakeNet(self, c),
                      event=lambda msg, *a, c=c: self.events[c].append(msg % a),
                      finished=lambda r, out, c=c: self.outcomes[c].append(out),
                      refusals=Refusals())
            for c in clusters}
        self.inbox: dict[str, queue.Queue[Any]] = {c: queue.Queue() for c in clusters}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._deliver, args=(c,), daemon=True)
                        for c in clusters] + [threading.Thread(target=self._tick, daemon=True)]
        for t in self.threads:
            t.start()

    def cut(self, cluster: str) -> None:
        """``cluster`` is gone: its peers (and it) see their links to each other go down."""
        self.up.discard(cluster)
        for c, r in self.rounds.items():
            for other in ([x for x in self.order if x != c] if c == cluster else [cluster]):
                r.control.on_link_down(other, "cut")

    def leave(self, cluster: str) -> None:
        """``cluster``'s relay is stopped: it says goodbye to its peers, then its links go."""
        self.left.add(cluster)
        self.cut(cluster)

    def rejoin(self, cluster: str) -> None:
        """``cluster`` is back: its links to every cluster that is up come up again."""
        self.up.add(cluster)
        self.left.discard(cluster)
        for r in self.rounds.values():
            r.control.on_link_up()

    def close(self) -> None:
        self.stop.set()
        for r in self.rounds.values():
            r.stop()
        for c in self.inbox:
            self.inbox[c].put(None)
        for t in self.threads:
            t.join(5)

    def _deliver(self, c: str) -> None:
        while (item := self.inbox[c].get()) is not None:
            src, frame = item
            if frame.type == FrameType.ROUND:  # decoded at the edge, as the relay does
                self.rounds[c].control.on_control(src, decode_round(frame.meta))
            else:
                self.rounds[c].control.on_chunk(src, PeerChunk.from_frame(frame))

    def _tick(self) -> None:
        while not self.stop.wait(0.02):
            for r in self.rounds.values():
                r.control.tick()


def run_round(hub: Hub, r: int, xs: dict[str, torch.Tensor],
              delays: dict[str, float] | None = None) -> dict[str, RoundOutcome]:
    def call(c: str) -> RoundOutcome:
        time.sleep((delays or {}).get(c, 0.0))
        return hub.rounds[c].local_round(r, xs[c])

    with ThreadPoolExecutor(len(xs)) as pool:
        futs = {c: pool.submit(call, c) for c in xs}
        return {c: f.result(timeout=30) for c, f in futs.items()}


def config(me: str, clusters: list[str], **kw: Any) -> RelayConfig:
    return RelayConfig(job_id="j", cluster=me, clusters=clusters, peer_listen="127.0.0.1:1",
                       worker_listen="127.0.0.1:2",
                       peers={c: "127.0.0.1:3" for c in clusters if c != me},
                       tls={"ca": "ca", "cert": "cert", "key": "key"},
                       **relay_defaults(**{"codec": "none", "round_timeout": 1.0,
                                           "heartbeat": 1.0, "chunk_numel": 256,
                                           "block_size": 64, **kw}))


class FakeNet:
    def __init__(self, hub: Hub, me: str) -> None:
        self.hub, self.me = hub, me

    def connected(self) -> list[str]:
        if self.me not in self.hub.up:
            return []
        return [c for c in self.hub.order if c != self.me and c in self.hub.up]

    def coordinator(self) -> str:
        return min([self.me, *self.connected()], key=self.hub.order.index)

    def peers_done(self) -> int:
        return max([-1, *(self.hub.rounds[c].state.done_round for c in self.connected())])

    def all_linked_once(self) -> bool:
        return True

    def send(self, cluster: str, frame: Frame, *, bulk: bool = False) -> bool:
        if cluster not in self.connected():
            return False
        payload = bytes(frame.payload)  # what a socket would carry: a copy
        self.hub.inbox[cluster].put((self.me, Frame(frame.type, dict(frame.meta), payload)))
        return True

    def flush(self, cluster: str, timeout: float) -> None:
        pass

    def fetch(self, cluster: str, ask: FetchRequest, timeout: float
              ) -> Average | GlobalState | None:
        if cluster not in self.connected():
            return None
        other = self.hub.rounds[cluster].state
        wait = 5.0 if ask.wait is None else ask.wait
        if isinstance(ask, ResultAsk):
            return other.answer_result(ask.round, min(wait, timeout, 5.0), lambda: False)
        return other.answer_state(ask.min_round, min(wait, 5.0))

    def holders(self, round_id: int) -> list[str]:
        return [c for c in self.connected() if (avg := self.hub.rounds[c].state.average) is not None
                and avg.round_id == round_id]

    def state_sources(self) -> list[tuple[str, int | None]]:
        def rnd(c: str) -> int | None:
            st = self.hub.rounds[c].state.published
            return None if st is None else st.round_id

        return sorted(((c, rnd(c)) for c in self.connected()), key=lambda x: -(x[1] or -1))

    def wan_bytes(self) -> tuple[int, int]:
        return (0, 0)

    def finish_view(self) -> dict[str, tuple[int | None, str | None, int]]:
        return {c: (r.finished, r.lineage, r.done_round) for c in self.connected()
                if (r := self.hub.rounds[c].state)}

    def departed(self) -> frozenset[str]:
        return frozenset(c for c in self.hub.left if c not in self.connected())
