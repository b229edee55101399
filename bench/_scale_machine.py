"""This machine's own bound on an outer round (bench/scale.py): what a relay of a two-cluster
round does to the same bytes, timed here on one thread (the relays' cores: a relay's torch
runs with OMP_NUM_THREADS=1 as the spec sets it), best of a few runs.

Per round and relay: its cluster's fp32 contribution copied once in (the worker's memfd to the
relay's buffer) and the average copied once out; the contribution encoded by the codec in the
relay's chunks (1 Mi elements), the peer's decoded; the encoded bytes sealed and opened with
AES-256-GCM in the relays' records (16 MiB each). The delay line's own work (a queue of the
received chunks) is left out, so the bound is a floor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK = 1 << 20
RECORD = 16 << 20


@dataclass(frozen=True)
class MachineRound:
    """The machine's time per stage for one relay's round of `params` fp32 elements."""

    params: int
    codec: str
    encoded_bytes: int
    copy_s: float
    encode_s: float
    decode_s: float
    gcm_s: float

    @property
    def seconds(self) -> float:
        return self.copy_s + self.encode_s + self.decode_s + self.gcm_s


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(params: int, codec_name: str, repeat: int = 3, seed: int = 0) -> MachineRound:
    """Time the stages of one relay's round (module docstring) on one thread."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from nebula_cli.config.sections import CompressionSpec
    from nebula_cli.relay.codecs.chunks import iter_chunks
    from nebula_cli.relay.codecs.registry import get_codec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        comp = CompressionSpec(codec=codec_name)
        codec = get_codec(codec_name, block_size=comp.block_size, density=comp.density,
                          bits=comp.bits)
        x = torch.randn(params, generator=torch.Generator().manual_seed(seed)) * 1e-2
        chunks = list(iter_chunks(x, CHUNK, align=comp.block_size))
        encoded = [codec.encode(c) for c in chunks]
        nbytes = sum(e.nbytes for e in encoded)
        into = torch.empty_like(x)

        def copies() -> None:
            into.copy_(x)
            x.copy_(into)

        payload = os.urandom(min(nbytes, RECORD))
        aes, nonce = AESGCM(os.urandom(32)), os.urandom(12)
        records = max(1, -(-nbytes // RECORD))

        def gcm() -> None:
            for _ in range(records):
                aes.decrypt(nonce, aes.encrypt(nonce, payload, None), None)

        return MachineRound(
            params=params, codec=codec_name, encoded_bytes=nbytes,
            copy_s=_best(copies, repeat),
            encode_s=_best(lambda: [codec.encode(c) for c in chunks], repeat),
            decode_s=_best(lambda: [codec.decode(e) for e in encoded], repeat),
            gcm_s=_best(gcm, repeat))
    finally:
        torch.set_num_threads(threads)
