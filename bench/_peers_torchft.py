"""One worker of torchft's DiLoCo for bench/peers.py (runs in the torchft venv, in a bed host).

A cluster is a torchft replica group: its two workers are one torch.distributed world (gloo over
the cluster's bridge, env:// from MASTER_ADDR/MASTER_PORT, the group's TCPStore), wrapped in
torch's DistributedDataParallel (the inner steps all-reduce gradients inside the cluster every
step, as DeepSpeed does in nebula's clusters). Across clusters, `torchft.Manager` (lighthouse
quorum, a `ProcessGroupGloo` between the groups' same ranks) and `torchft.local_sgd.DiLoCo`:
every `--sync-every` inner steps each rank all-reduces its pseudo-gradient with the other
group's rank of the same number and takes the outer step (SGD, Nesterov).

Configured as torchft 0.2.0's own DiLoCo examples do (`train_diloco.py` at the repository's
root, `torchft/_test/diloco_trainer.py`, `torchft/local_sgd_integ_test.py`): `Manager(pg=
ProcessGroupGloo(...), use_async_quorum=False, min_replica_size=..., replica_id=..., ...)`
(DiLoCo requires a synchronous quorum), `DiLoCo(manager, [model], inner_optimizer,
outer_optimizer, sync_every=H, backup_device=cpu)` with `should_quantize=False` (its
quantised all-reduce needs Triton and a GPU) and no fragments (plain DiLoCo);
`init_sync=False` since every worker builds the same weights from the seed (Manager's
docstring). The outer lr and momentum are the same as nebula's int8 row (bench/peers.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_train import Log, Work, adamw, clip, warmup  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", type=int, required=True, help="replica group (cluster index)")
    p.add_argument("--address", required=True, help="this host's address on the bed")
    p.add_argument("--lighthouse", required=True, help="http://addr:port of the lighthouse")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--sync-every", type=int, required=True)
    p.add_argument("--outer-lr", type=float, required=True)
    p.add_argument("--outer-momentum", type=float, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--metrics", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from torch.nn.parallel import DistributedDataParallel
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # this cluster's world: RANK, WORLD_SIZE, MASTER_* (env)
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Work.build(seed=args.seed, cluster=args.cluster, rank=rank,
                      micro_batch=args.micro_batch)
    log = Log(args.metrics, cluster=args.cluster, rank=rank)
    model = work.model
    ddp = DistributedDataParallel(model)
    inner = adamw(model.parameters())
    schedule = warmup(inner)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr,
                            momentum=args.outer_momentum, nesterov=True)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])

    long = timedelta(seconds=600)  # rounds over a 20 Mbit/s link; a quorum once per H steps
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=args.replicas, use_async_quorum=False,
        replica_id=f"cluster_{args.cluster}", store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]), rank=rank, world_size=world,
        lighthouse_addr=args.lighthouse, hostname=args.address, init_sync=False,
        timeout=long, quorum_timeout=long, connect_timeout=timedelta(seconds=60))
    loss_sum = 0.0
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every,
                    backup_device=torch.device("cpu"), should_quantize=False):
            for step in range(1, args.steps + 1):
                loss = work.loss(ddp)
                inner.zero_grad()
                loss.backward()
                clip(model)
                inner.step()  # DiLoCo's hook: the outer round after every H-th step
                schedule.step()
                loss_sum += float(loss)
                log.step_done(step)
                record: dict = {}
                if step == 1 or step % 10 == 0:
                    record["loss"] = loss_sum / (1 if step == 1 else 10)
                    loss_sum = 0.0
                if step % args.sync_every == 0 or step == args.steps:
                    record["eval_loss"] = work.evaluate()
                    record["outer_round"] = step // args.sync_every
                if record:
                    log(step, **record)
        log(args.steps, final=True, eval_loss=work.evaluate(), param_sha256=work.checksum(),
            s_per_step=log.s_per_step(args.steps), committed=manager.current_step())
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
