"""Codec speed and accuracy on one flat fp32 tensor (a stand-in for a DiLoCo pseudo-gradient).

For every codec: encode and decode throughput in GB/s of fp32 input (best of --repeat runs),
bytes on the wire per element, and the relative error of y = decode(encode(x)): elementwise
|y - x| / |x| (max and mean over the non-zero elements; int8 sends elements far below their
block's absmax as 0, so its max is 1) and the norm ratio ||y - x|| / ||x||. "bound" says whether
every element stayed within the codec's own max_abs_error. topk runs at the spec's default
density and bits and at the variants in TOPK_VARIANTS; it sends a fraction of the elements, so
its errors are those of one round without the error feedback that carries the rest into the
next. With --json the last line is one JSON object.

    .venv/bin/python bench/codecs.py [--numel 16777216] [--repeat 5] [--block-size 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from nebula_cli.codecs.int8.params import Int8Params
from nebula_cli.codecs.topk.params import TopKParams
from nebula_cli.relay.codecs.base import Codec
from nebula_cli.relay.codecs.registry import KNOWN_CODECS, get_codec

TOPK = TopKParams()
"""topk at its defaults (the spec's)."""
TOPK_VARIANTS = ((TOPK.density, 4), (0.125, 2), (0.02, 2))
"""(density, bits) of topk measured besides the default."""


def best_of(repeat: int, fn: Any) -> tuple[float, Any]:
    """(fastest wall time, last result) over repeat calls after one warm-up call."""
    result = fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(codec: Codec, x: torch.Tensor, repeat: int) -> dict[str, Any]:
    gb_in = 4 * x.numel() / 1e9
    enc_s, enc = best_of(repeat, lambda: codec.encode(x))
    dec_s, y = best_of(repeat, lambda: codec.decode(enc))
    err = (y.double() - x.double()).abs()
    ax = x.double().abs()
    nz = ax > 0
    rel = err[nz] / ax[nz]
    return {
        "bytes_per_element": enc.nbytes / x.numel(),
        "compression": 4 * x.numel() / enc.nbytes,
        "encode_gbps": gb_in / enc_s,
        "decode_gbps": gb_in / dec_s,
        "encode_ms": enc_s * 1e3,
        "decode_ms": dec_s * 1e3,
        "max_rel_err": rel.max().item() if rel.numel() else 0.0,
        "mean_rel_err": rel.mean().item() if rel.numel() else 0.0,
        "norm_rel_err": (err.norm() / ax.norm()).item() if rel.numel() else 0.0,
        "bound_held": bool((err <= codec.max_abs_error(x).double()).all()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=Int8Params.block_size)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.numel, generator=gen) * 1e-2
    codecs = {name: get_codec(name, block_size=args.block_size) for name in KNOWN_CODECS
              if name != "topk"}
    for density, bits in ((TOPK.density, TOPK.bits), *TOPK_VARIANTS):
        codecs[f"topk {density:g} {bits}b"] = get_codec("topk", density=density, bits=bits)
    results = {name: measure(codec, x, args.repeat) for name, codec in codecs.items()}

    table = Table(
        title=f"codecs on {args.numel:,} fp32 elements ({4 * args.numel / 2**20:.0f} MiB), "
        f"randn*1e-2, {torch.get_num_threads()} torch threads, best of {args.repeat}"
    )
    for col in (
        "codec",
        "B/elem",
        "ratio",
        "encode GB/s",
        "decode GB/s",
        "max rel err",
        "mean rel err",
        "norm rel err",
        "bound",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['bytes_per_element']:.3f}",
            f"{r['compression']:.2f}x",
            f"{r['encode_gbps']:.2f}",
            f"{r['decode_gbps']:.2f}",
            f"{r['max_rel_err']:.2e}",
            f"{r['mean_rel_err']:.2e}",
            f"{r['norm_rel_err']:.2e}",
            "held" if r["bound_held"] else "BROKEN",
        )
    Console(width=120).print(table)
    summary = {
        "numel": args.numel,
        "block_size": args.block_size,
        "repeat": args.repeat,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "codecs": results,
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
