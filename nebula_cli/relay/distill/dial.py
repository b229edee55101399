"""Opening a link to a label relay: TCP, mutual TLS with the job's certificates (the relay's
own or a worker's of its cluster), HELLO, and its WELCOME (or its refusal, as an error)."""

from __future__ import annotations

import contextlib
import socket
import ssl

from nebula_cli.pki import PeerRejected, wrap_client
from nebula_cli.relay.distill.link import LabelLink
from nebula_cli.relay.distill.messages import LabelHello, LabelWelcome, Side
from nebula_cli.relay.net.schema import decode
from nebula_cli.relay.net.wire import FrameType, WireError, recv_small_frame, send_frame

WELCOME_BYTES = 4096


class LabelRefused(WireError):
    """A label relay refused this side (its reason) or could not be reached."""


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def dial(addr: str, ctx: ssl.SSLContext, *, job_id: str, cluster: str, side: Side,
         max_payload: int, timeout: float) -> tuple[LabelLink, LabelWelcome]:
    """A link to the label relay of teacher cluster ``cluster`` at ``addr`` (host:port) as
    ``side``; LabelRefused naming the relay and why when it cannot be had."""
    try:
        sock = socket.create_connection(split_addr(addr), timeout=timeout)
    except OSError as exc:
        raise LabelRefused(f"label relay {addr}: cannot connect: {exc}") from None
    try:
        tls, _ = wrap_client(sock, ctx, job_id=job_id, roles={"worker", "relay"},
                             cluster=cluster, timeout=timeout)
    except PeerRejected as exc:
        raise LabelRefused(f"label relay {addr}: {exc.reason}") from None
    try:
        tls.settimeout(timeout)
        send_frame(tls, LabelHello(job=job_id, side=side).to_frame())
        frame = recv_small_frame(tls, WELCOME_BYTES)
        if frame.type is FrameType.ERROR:
            raise LabelRefused(f"label relay {addr} refused us: {frame.meta.get('reason')}")
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
    return LabelLink(tls, f"{welcome.cluster} ({addr})", max_payload), welcome
