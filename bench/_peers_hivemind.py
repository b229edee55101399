"""One hivemind peer for bench/peers.py (runs in the hivemind venv, in a bed host), or with
--dht-only the bootstrap DHT peer the others join.

hivemind has no notion of a cluster: each of the bed's workers is a peer, as in hivemind's
quickstart (docs/user/quickstart.md: "Decentralized Training") and examples/albert
(run_trainer.py: one peer per machine). Its `hivemind.Optimizer` wraps the worker's inner
optimizer with `use_local_updates=True` (the quickstart's setting: "perform optimizer steps with
local gradients, average parameters in background"): every peer steps on its own gradients,
and once the peers together have processed `target_batch_size` samples (here all workers'
samples of `--sync-every` steps, the H of the DiLoCo rows) they average parameters in the
background (`delay_state_averaging`, the default) with `state_averaging_compression=
Float16Compression()` (examples/albert/run_trainer.py), `matchmaking_time=5.0` and
`averaging_timeout=60.0` (examples/albert/arguments.py's defaults). The DHT listens on the
host's bed address (`host_maddrs`), the peers join the bootstrap's multiaddr
(`initial_peers`), as docs/user/dht.md says for peers on several machines, and also every peer
started before them (the docs allow "one (or a subset) of peers"): the bed's addresses are in
198.18.0.0/15, which libp2p does not keep in its DHT's routing tables (it treats the
benchmarking range as unroutable, it seems), so p2pd could not find a peer it had not been
connected to ("P2PDaemonError: routing: not found", every averaging round failing with "could
not find a group"; two peers on 127.0.0.1 averaged fine). With every pair connected once at the
start, each p2pd knows the others' addresses from libp2p's identify exchange.

The inner optimizer is the same torch AdamW as every other row's; it is handed to
hivemind.Optimizer already made, and its per-step warmup is a LambdaLR this script steps
after each local step (hivemind calls a `scheduler=` only once per epoch, which would not be
the same inner schedule as the other rows').
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_train import Log, Work, adamw, clip, warmup  # noqa: E402

RUN_ID = "nebula_bench_peers"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="this host's address on the bed")
    p.add_argument("--dht-only", action="store_true",
                   help="run the bootstrap DHT peer: print MADDR <multiaddr>, wait for SIGTERM")
    p.add_argument("--initial-peer", action="append", default=[],
                   help="a peer's multiaddr to join (repeat: the bootstrap and every peer "
                        "started before this one)")
    p.add_argument("--cluster", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--peers", type=int, default=4, help="training peers in all")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics", type=Path, default=None)
    p.add_argument("--go-file", type=Path, default=None,
                   help="once ready, wait for this file before the first step (every peer "
                        "starts training at the same time)")
    return p.parse_args(argv)


def own_maddr(dht: object, address: str) -> str:
    """The multiaddr (with /p2p/<peer id>) other peers dial to reach this one on the bed."""
    return next(str(m) for m in dht.get_visible_maddrs() if address in str(m))


def bootstrap(address: str) -> int:
    import hivemind

    dht = hivemind.DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], start=True)
    print(f"MADDR {own_maddr(dht, address)}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.dht_only:
        import signal

        signal.signal(signal.SIGTERM, signal.default_int_handler)
        return bootstrap(args.address)
    import hivemind
    from hivemind.compression import Float16Compression

    work = Work.build(seed=args.seed, cluster=args.cluster, rank=args.rank,
                      micro_batch=args.micro_batch)
    log = Log(args.metrics, cluster=args.cluster, rank=args.rank)
    model = work.model
    inner = adamw(model.parameters())
    schedule = warmup(inner)
    dht = hivemind.DHT(initial_peers=args.initial_peer,
                       host_maddrs=[f"/ip4/{args.address}/tcp/0"], start=True)
    opt = hivemind.Optimizer(
        dht=dht, run_id=RUN_ID, batch_size_per_step=args.micro_batch,
        target_batch_size=args.micro_batch * args.peers * args.sync_every,
        optimizer=inner, use_local_updates=True, matchmaking_time=5.0, averaging_timeout=60.0,
        state_averaging_compression=Float16Compression(), verbose=True)
    print(f"MADDR {own_maddr(dht, args.address)}", flush=True)  # ready: the next peer joins
    deadline = time.monotonic() + 900
    while args.go_file is not None and not args.go_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{args.go_file} did not appear in 900 s")
        time.sleep(0.05)
    loss_sum = 0.0
    try:
        for step in range(1, args.steps + 1):
            loss = work.loss(model)
            opt.zero_grad()
            loss.backward()
            clip(model)
            opt.step()  # local update; parameters averaged in the background once per epoch
            schedule.step()
            loss_sum += float(loss)
            log.step_done(step)
            record: dict = {}
            if step == 1 or step % 10 == 0:
                record["loss"] = loss_sum / (1 if step == 1 else 10)
                loss_sum = 0.0
            if step % args.sync_every == 0 or step == args.steps:
                record["eval_loss"] = work.evaluate()
                record["epoch"] = opt.local_epoch
            if record:
                log(step, **record)
        log(args.steps, final=True, eval_loss=work.evaluate(), param_sha256=work.checksum(),
            s_per_step=log.s_per_step(args.steps), epoch=opt.local_epoch)
    finally:
        opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
