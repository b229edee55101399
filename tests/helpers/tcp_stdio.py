"""A ProxyCommand for tests, like `nc HOST PORT`: connects to HOST:PORT and carries its
standard input and output over the connection; touches MARKER first (proof it was used).

    python tcp_stdio.py HOST PORT MARKER
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path


def main() -> None:
    host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    Path(marker).write_text(f"{host} {port}\n")
    sock = socket.create_connection((host, port))

    def upstream() -> None:
        while data := os.read(0, 65536):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := sock.recv(65536):
        os.write(1, data)


if __name__ == "__main__":
    main()
