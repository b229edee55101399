"""``python -m nebula_cli.relay --config relay.json``: run this cluster's relay until SIGTERM or
SIGINT, or until every cluster's workers have finished (`Relay.ended`); exit 0 on a clean stop,
1 if it cannot start (a port taken), 2 on a bad config."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import threading
from typing import Any

import torch

from nebula_cli.config.parts import LEAVE_SIGNAL
from nebula_cli.config.relay_config import RelayConfig
from nebula_cli.errors import NebulaError

log = logging.getLogger("nebula.relay")


def main(argv: list[str] | None = None, prog: str = "python -m nebula_cli.relay") -> int:
    """Entry point: run a relay until SIGTERM/SIGINT; 0 on a clean stop, 2 on a bad config."""
    from nebula_cli.relay.process.server import Relay

    parser = argparse.ArgumentParser(prog=prog, description="nebula gradient relay of one cluster")
    parser.add_argument("--config", required=True, help="path of relay.json")
    parser.add_argument("--log-level", default=os.environ.get("NEBULA_RELAY_LOG", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = RelayConfig.load(args.config)
        relay = Relay(cfg)
    except NebulaError as exc:
        log.error("%s", exc)
        return 2
    torch.set_num_threads(1)  # the relay's threads (links, encoder, rounds) are its parallelism:
    # torch's own pool on top of them oversubscribes the cores (an add ran 4x slower with it)
    gc.collect()
    gc.freeze()  # the modules' objects (torch's many) are never scanned again by a collection
    stop = threading.Event()
    up = threading.Event()  # start() returned: from then on relay.stop() ends it, in order

    def stop_starting() -> None:
        """A signal while the relay starts also ends the start's waits (its port's)."""
        stop.set()
        if not up.is_set():
            relay.stopping.set()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop_starting()

    def on_leave(signum: int, _frame: Any) -> None:
        log.info("signal %d: this cluster leaves the job; stopping", signum)
        relay.leaving = True
        stop_starting()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(LEAVE_SIGNAL, on_leave)
    try:
        relay.start()
    except NebulaError as exc:
        if stop.is_set():  # told to stop while it started: a clean stop
            relay.stop()
            log.info("relay %s stopped before it was up (%s)", cfg.cluster, exc)
            return 0
        log.error("%s", exc)
        return 1
    up.set()
    try:
        while not stop.wait(0.5) and not relay.ended.is_set():
            pass
    finally:
        relay.stop()
    log.info("relay %s stopped", cfg.cluster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
