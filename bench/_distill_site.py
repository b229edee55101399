"""A process of bench/distill.py's sites: a teacher that serves soft labels from saved weights,
or the link (bench/_slow_link.py) in front of one. A teacher at another site runs on hardware
of its own and a link costs its ends no CPU: as processes of their own (pinned to CPUs the
student does not use, where the machine has them) they take nothing from the student's
process but what the student's own label client does.

    python bench/_distill_site.py teacher CONFIG.json WEIGHTS.pt VOCAB EMBD LAYERS WIDTH
    python bench/_distill_site.py link HOST PORT DELAY_MS [RATE_MBIT]

Each prints one line when it is ready (`ready`, or `port N`: where the link listens) and runs
until its standard input closes (the bench ended, or died) or it is killed. `--cpus 0,1` pins
it first. `site(...)` (imported by the bench) starts one as a child, in the calling thread's
network namespace, and waits for its line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def site(*argv: str, cpus: set[int] | None = None, timeout: float = 120
         ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A site's process (`argv` as above) and its ready line; ended (killed) with the block."""
    pin = ["--cpus", ",".join(map(str, sorted(cpus)))] if cpus else []
    proc = subprocess.Popen([sys.executable, str(HERE / "_distill_site.py"), *pin, *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=HERE.parent)
    _STARTED.append(proc)
    try:
        assert proc.stdout is not None
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0].strip():
            raise RuntimeError(f"site {argv[0]} did not come up (exit {proc.poll()})")
        yield proc, line[0].strip()
    finally:
        proc.kill()
        proc.wait()


_STARTED: list[subprocess.Popen[str]] = []


def site_processes() -> list[int]:
    """The pids of the site processes this process started that still run."""
    return [p.pid for p in _STARTED if p.poll() is None]


def _until_stdin_closes(stop: threading.Event) -> None:
    sys.stdin.read()
    stop.set()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpus", help="CPUs to run on, e.g. 0 or 0,1")
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("teacher")
    for name in ("config", "weights"):
        t.add_argument(name)
    for name in ("vocab", "embd", "layers", "width"):
        t.add_argument(name, type=int)
    link = sub.add_parser("link")
    link.add_argument("host")
    link.add_argument("port", type=int)
    link.add_argument("delay_ms", type=float)
    link.add_argument("rate_mbit", type=float, nargs="?")
    args = p.parse_args(argv)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    stop = threading.Event()
    threading.Thread(target=_until_stdin_closes, args=(stop,), daemon=True).start()
    if args.kind == "link":
        sys.path.insert(0, str(HERE))
        from _slow_link import SlowLink

        proxy = SlowLink((args.host, args.port), args.delay_ms, args.rate_mbit)
        print(f"port {proxy.port}", flush=True)
        os.dup2(2, 1)
        stop.wait()
        proxy.close()
        return
    sys.path.insert(0, str(HERE.parent))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from nebula_cli.config.distill_config import DistillConfig
    from nebula_cli.runtime.distill import serve

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.width,
                                       n_embd=args.embd, n_layer=args.layers, n_head=4))
    model.load_state_dict(torch.load(args.weights, weights_only=True))
    model.eval()
    config = DistillConfig.load(args.config)
    print("ready", flush=True)
    # from here on its stdout (the teacher's figures) goes to stderr: the bench reads the
    # pipe once, and a full pipe would stop the teacher
    os.dup2(2, 1)
    serve(lambda ids: model(ids).logits, vocab=args.vocab, config=config, rank=0, stop=stop)


if __name__ == "__main__":
    main()
