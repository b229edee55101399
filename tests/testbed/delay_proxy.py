"""A TCP proxy that adds a fixed one-way delay to each direction of every stream.

netem does not exist on the test machines' kernel, so the test bed emulates WAN latency in user
space: this proxy listens on one address, connects each accepted stream to a target, and hands
every chunk it reads to the other side `delay_ms` after it was read. Reading never waits for
writing (a timestamped queue sits between them), so a delayed stream keeps its throughput: this is
a delay line, not stop-and-wait. A round trip through the proxy takes at least 2 x delay_ms.

Bounds: at most `--max-conns` streams at once (more are accepted and closed at once), and at most
`--max-buffer` bytes queued per direction (the reader then waits, which pushes back on the
sender through TCP). Every wait is bounded so that SIGTERM/SIGINT ends the process within a
fraction of a second; half-closes (EOF) are passed on in order after the data before them.

Only the standard library is used so that it runs as a plain script under `ip netns exec`:

    python delay_proxy.py --listen 198.18.0.254:0 --target 198.18.1.1:5201 --delay-ms 50 \
        [--source 198.18.0.254]

It prints one line `LISTENING <addr> <port>` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
import time
from collections import deque

CHUNK = 256 * 1024
POLL = 0.2  # seconds: the longest any thread waits before it looks at the stop flag again


class DelayLine:
    """A FIFO of (due time, bytes) with a cap on the bytes it holds; None marks end of stream."""

    def __init__(self, delay: float, max_bytes: int, stop: threading.Event) -> None:
        self._delay = delay
        self._max = max_bytes
        self._stop = stop
        self._items: deque[tuple[float, bytes | None]] = deque()
        self._bytes = 0
        self._cond = threading.Condition()

    def put(self, data: bytes | None) -> bool:
        """Queue data (or EOF) to be due `delay` from now; False when the line was stopped."""
        size = len(data) if data else 0
        with self._cond:
            while self._bytes and self._bytes + size > self._max:
                if self._stop.is_set():
                    return False
                self._cond.wait(POLL)
            self._items.append((time.monotonic() + self._delay, data))
            self._bytes += size
            self._cond.notify_all()
        return True

    def get(self) -> tuple[bool, bytes | None]:
        """Wait for the oldest item to fall due; (False, None) when the line was stopped."""
        with self._cond:
            while not self._items:
                if self._stop.is_set():
                    return False, None
                self._cond.wait(POLL)
            due, data = self._items[0]
        while (left := due - time.monotonic()) > 0:
            if self._stop.wait(min(left, POLL)):
                return False, None
        with self._cond:
            self._items.popleft()
            self._bytes -= len(data) if data else 0
            self._cond.notify_all()
        return True, data


class Stream:
    """One proxied connection: two directions, each a reader thread and a writer thread."""

    def __init__(self, client: socket.socket, upstream: socket.socket, delay: float,
                 max_bytes: int, on_done) -> None:
        self.socks = (client, upstream)
        self.stop = threading.Event()
        self._on_done = on_done
        self._open_directions = 2
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        for src, dst in ((client, upstream), (upstream, client)):
            line = DelayLine(delay, max_bytes, self.stop)
            self.threads.append(threading.Thread(target=self._read, args=(src, line), daemon=True))
            self.threads.append(threading.Thread(target=self._write, args=(dst, line), daemon=True))
        for thread in self.threads:
            thread.start()

    def _read(self, src: socket.socket, line: DelayLine) -> None:
        try:
            while not self.stop.is_set():
                data = src.recv(CHUNK)
                if not line.put(data or None) or not data:
                    return
        except OSError:
            self.close()

    def _write(self, dst: socket.socket, line: DelayLine) -> None:
        try:
            while True:
                alive, data = line.get()
                if not alive:
                    return
                if data is None:
                    dst.shutdown(socket.SHUT_WR)
                    break
                dst.sendall(data)
        except OSError:
            self.close()
            return
        with self._lock:
            self._open_directions -= 1
            finished = self._open_directions == 0
        if finished:
            self.close()

    def close(self) -> None:
        """End both directions at once (idempotent)."""
        with self._lock:
            if self.stop.is_set():
                return
            self.stop.set()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._on_done(self)


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host, int(port)


def serve(listen: tuple[str, int], target: tuple[str, int], delay_ms: float, *,
          source: str | None, max_conns: int, max_buffer: int, stop: threading.Event) -> None:
    """Accept and proxy streams until `stop` is set, then close every stream."""
    streams: set[Stream] = set()
    lock = threading.Lock()

    def done(stream: Stream) -> None:
        with lock:
            streams.discard(stream)

    server = socket.create_server(listen, backlog=max_conns)
    server.settimeout(POLL)
    addr, port = server.getsockname()[:2]
    print(f"LISTENING {addr} {port}", flush=True)
    try:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            with lock:
                full = len(streams) >= max_conns
            if full:
                client.close()
                continue
            try:
                upstream = socket.create_connection(
                    target, timeout=10, source_address=(source, 0) if source else None)
            except OSError as exc:
                print(f"delay_proxy: cannot reach {target[0]}:{target[1]}: {exc}",
                      file=sys.stderr, flush=True)
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = Stream(client, upstream, delay_ms / 1000.0, max_buffer, done)
            with lock:
                streams.add(stream)
    finally:
        server.close()
        with lock:
            remaining = list(streams)
        for stream in remaining:
            stream.close()
        for stream in remaining:
            for thread in stream.threads:
                thread.join(timeout=2 * POLL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=parse_addr, required=True, help="addr:port (port 0: any)")
    parser.add_argument("--target", type=parse_addr, required=True, help="addr:port")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    parser.add_argument("--source", help="local address for the connections to the target")
    parser.add_argument("--max-conns", type=int, default=64)
    parser.add_argument("--max-buffer", type=int, default=64 << 20, help="bytes per direction")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.max_conns < 1 or args.max_buffer < CHUNK:
        parser.error("need --delay-ms >= 0, --max-conns >= 1, --max-buffer >= 256 KiB")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serve(args.listen, args.target, args.delay_ms, source=args.source,
          max_conns=args.max_conns, max_buffer=args.max_buffer, stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
