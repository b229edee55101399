"""Opening a link to a label relay: TCP, mutual TLS with the job's certificates (the relay's
own or a worker's of its cluster), HELLO, and its WELCOME (or its refusal, as an error)."""

from __future__ import annotations

import contextlib
import socket
import ssl

from nebula_cli.pki import PeerRejected, wrap_client
from nebula_cli.relay.distill.link import LabelLink, queue_bound
from nebula_cli.relay.distill.messages import (
    LabelHello,
    LabelRefusal,
    LabelWelcome,
    Side,
    max_answer_bytes,
    max_ask_bytes,
)
from nebula_cli.relay.net.schema import decode
from nebula_cli.relay.net.wire import FrameType, WireError, recv_small_frame, send_frame

WELCOME_BYTES = 4096


class LabelRefused(WireError):
    """A label relay refused this side (its reason) or could not be reached."""


class RelayRefused(LabelRefused):
    """A label relay that was reached refused this side, saying why (worth a warning: dialling
    again is refused again until what it names changes)."""


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def dial(addr: str, ctx: ssl.SSLContext, *, hello: LabelHello, cluster: str,
         max_payload: int, timeout: float) -> tuple[LabelLink, LabelWelcome]:
    """A link to the label relay of teacher cluster ``cluster`` at ``addr`` (host:port), as
    ``hello`` says; LabelRefused naming the relay and why when it cannot be had. Its sender's
    queue holds what the WELCOME lets this side have outstanding."""
    try:
        sock = socket.create_connection(split_addr(addr), timeout=timeout)
    except OSError as exc:
        raise LabelRefused(f"label relay {addr}: cannot connect: {exc}") from None
    try:
        tls, _ = wrap_client(sock, ctx, job_id=hello.job, roles={"worker", "relay"},
                             cluster=cluster, timeout=timeout)
    except PeerRejected as exc:
        raise LabelRefused(f"label relay {addr}: {exc.reason}") from None
    try:
        tls.settimeout(timeout)
        send_frame(tls, hello.to_frame())
        frame = recv_small_frame(tls, WELCOME_BYTES)
        if frame.type is FrameType.ERROR:
            why = decode(LabelRefusal, frame.meta).reason
            raise RelayRefused(f"label relay {addr} refused us: {why}")
        if frame.type is not FrameType.WELCOME:
            raise LabelRefused(f"label relay {addr}: answered {frame.type.name} to HELLO")
        welcome = decode(LabelWelcome, frame.meta)
        tls.settimeout(None)
    except (WireError, OSError) as exc:
        with contextlib.suppress(OSError):
            tls.close()
        if isinstance(exc, LabelRefused):
            raise
        raise LabelRefused(f"label relay {addr}: {exc}") from None
    sent = (max_ask_bytes(welcome.max_tokens) if hello.side is Side.STUDENT
            else max_answer_bytes(welcome.max_tokens, welcome.topk))
    return LabelLink(tls, f"{welcome.cluster} ({addr})", max_payload,
                     queue_bytes=queue_bound(welcome.max_asks, sent)), welcome
