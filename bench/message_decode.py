"""What decoding a round's frames costs the relay and its worker: the metas one relay and its
rank 0 decode in a round between two clusters, parsed once (as `recv_frame` leaves them) and
then decoded into their messages, many rounds over.

    .venv/bin/python bench/message_decode.py [--rounds 2000] [--repeat 5] [--chunks 32] [--json]

A round's frames (protocol 2's keys, as the relay sends them): the worker's CONTRIB, the peer's
READY, the coordinator's START, ``--chunks`` PEER_CHUNK headers of int8 chunks (their codec's
header read too, as `PeerChunk.from_frame` does), the worker's RESULT header and two
HEARTBEATs (a peer's progress). Printed: CPU microseconds per round, best and median of
``--repeat``, and per frame. Runs against any checkout (the decoders it calls exist before and
after the messages were declared once), so that two commits can be compared on one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from nebula_cli.relay.codecs.registry import get_codec  # noqa: E402
from nebula_cli.relay.net.messages import decode_heartbeat  # noqa: E402
from nebula_cli.relay.net.wire import Frame, FrameType  # noqa: E402
from nebula_cli.relay.process.worker_messages import RoundReply, decode_request  # noqa: E402
from nebula_cli.relay.protocol.messages import ChunkKind, PeerChunk, decode_round  # noqa: E402

try:  # the messages declared once (relay/net/schema.py)
    from nebula_cli.relay.net.schema import decode

    def decode_reply(meta: dict[str, Any]) -> Any:
        return decode(RoundReply, meta)
except ImportError:  # before: each message's own from_meta
    def decode_reply(meta: dict[str, Any]) -> Any:
        return RoundReply.from_meta(meta)

JSON_FIELDS = ("us_per_round", "us_per_round_median", "us_per_frame", "frames_per_round")

CONTRIB = {"op": "allreduce", "round": 3, "numel": 16_777_216,
           "info": {"weight": 32.0, "step_s": 0.2, "comm_s": 1.5}, "released": [4, 5]}
READY = {"op": "ready", "round": 4, "attempt": 0, "ok": True, "numel": 16_777_216,
         "reason": "", "lineage": "3f2a9c", "info": {"weight": 64.0, "step_s": 0.1},
         "codec": "int8", "codec_round": 3}
START = {"op": "start", "round": 4, "attempt": 0, "coord": "a", "present": ["a", "b"],
         "rejected": [], "missing": [], "numel": 16_777_216, "diverged": [],
         "weights": {"a": 64.0, "b": 32.0}, "codec": "int8", "next_h": 40,
         "next_merge": None, "next_codec": "int8", "why": "step 0.1 s (slowest)"}
RESULT = {"round_id": 4, "present": ["a", "b"], "next_h": 40, "next_merge": None,
          "next_codec": "int8", "why": "step 0.1 s (slowest)", "codec": "int8",
          "weights": {"a": 64.0, "b": 32.0}, "rejected": [], "missing": [], "seconds": 1.5,
          "bytes_sent": 100, "bytes_received": 200, "upload_s": 0.25, "has_state": False,
          "mode": "shard", "numel": 16_777_216, "shm": 7}
PROGRESS = {"done": 3, "state_round": 2, "result_round": 3, "sync": None, "finished": None,
            "lineage": "3f2a9c"}


def round_frames(chunks: int) -> list[tuple[str, Frame]]:
    """(what decodes it, frame) for every frame of a round, parsed as received."""
    enc = get_codec("int8", block_size=64).encode(torch.arange(512, dtype=torch.float32))
    chunk = PeerChunk(kind=ChunkKind.CONTRIB, round=4, attempt=0, coord="a", k=0, enc=enc)
    sent = chunk.to_frame()
    frames = [("request", Frame(FrameType.CONTRIB, json.loads(json.dumps(CONTRIB)))),
              ("round", Frame(FrameType.ROUND, json.loads(json.dumps(READY)))),
              ("round", Frame(FrameType.ROUND, json.loads(json.dumps(START))))]
    for k in range(chunks):
        meta = json.loads(json.dumps({**sent.meta, "k": k}))
        frames.append(("chunk", Frame(FrameType.PEER_CHUNK, meta, bytearray(sent.payload))))
    frames.append(("reply", Frame(FrameType.RESULT, json.loads(json.dumps(RESULT)))))
    frames += [("heartbeat", Frame(FrameType.HEARTBEAT, json.loads(json.dumps(PROGRESS))))] * 2
    return frames


DECODERS = {"request": decode_request, "round": lambda f: decode_round(f.meta),
            "chunk": PeerChunk.from_frame, "reply": lambda f: decode_reply(f.meta),
            "heartbeat": lambda f: decode_heartbeat(f.meta)}


def one_pass(frames: list[tuple[str, Frame]], rounds: int) -> float:
    """CPU seconds of this process to decode ``rounds`` rounds of ``frames`` (CPU time: the
    machine's other load moves it less than wall time)."""
    calls = [(DECODERS[what], f) for what, f in frames]
    t0 = time.process_time()
    for _ in range(rounds):
        for dec, f in calls:
            dec(f)
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2000, help="rounds decoded per repeat")
    p.add_argument("--repeat", type=int, default=5, help="repeats (best and median shown)")
    p.add_argument("--chunks", type=int, default=32, help="PEER_CHUNK frames in a round")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    args = p.parse_args(argv)
    frames = round_frames(args.chunks)
    one_pass(frames, max(1, args.rounds // 10))  # warm
    runs = [one_pass(frames, args.rounds) / args.rounds * 1e6 for _ in range(args.repeat)]
    out = {"us_per_round": round(min(runs), 2),
           "us_per_round_median": round(statistics.median(runs), 2),
           "us_per_frame": round(min(runs) / len(frames), 3),
           "frames_per_round": len(frames), "repo": str(REPO)}
    print(f"{len(frames)} frames a round ({args.chunks} chunks), {args.rounds} rounds x "
          f"{args.repeat}: {out['us_per_round']} us a round (median "
          f"{out['us_per_round_median']}), {out['us_per_frame']} us a frame")
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
