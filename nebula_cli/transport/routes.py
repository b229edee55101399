"""Which network interface a host reaches an address through: what gloo and NCCL must be told.

Without ``GLOO_SOCKET_IFNAME`` gloo advertises the address its host name resolves to, and
Debian and Ubuntu map the machine's own name to 127.0.1.1 in /etc/hosts (many images to
127.0.0.1): the other hosts of the cluster are then told to connect to a loopback address, and
rendezvous fails ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). When the spec names no
interface, the plan asks every host of a multi-host world which interface its kernel routes to
a peer of that world through, and sets ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` to it.

`ROUTE_PY` runs on the host under the cluster's python (standard library only): ``ip -o route
get`` when iproute2 is there, else the kernel's choice of source address for a UDP socket
``connect`` (nothing is sent) matched to an interface's address. Prints one JSON object.
"""

from __future__ import annotations

import json

from nebula_cli.errors import TransportError

ROUTE_PY = r"""
import json, socket, subprocess, sys
out = {"interface": None, "source": None, "address": None}
try:
    info = socket.getaddrinfo(sys.argv[1], None, socket.AF_INET, socket.SOCK_DGRAM)
    addr = out["address"] = info[0][4][0]
except OSError as exc:
    out["error"] = "cannot resolve %s: %s" % (sys.argv[1], exc)
    print(json.dumps(out)); sys.exit(0)
try:
    words = subprocess.run(["ip", "-o", "-4", "route", "get", addr], capture_output=True,
                           text=True, timeout=10).stdout.split()
    for key in ("dev", "src"):
        if key in words[:-1]:
            out["interface" if key == "dev" else "source"] = words[words.index(key) + 1]
except (OSError, subprocess.SubprocessError):
    pass
if out["interface"] is None:
    import fcntl, struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((addr, 9))
        src = out["source"] = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                mine = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            except OSError:
                continue
            if mine == src:
                out["interface"] = name
                break
    except OSError as exc:
        out["error"] = "no route to %s: %s" % (addr, exc)
print(json.dumps(out))
"""


def parse_route(stdout: str, host: str, address: str) -> str:
    """The interface from ROUTE_PY's output ("lo" when the peer is this machine, as for local
    clusters); TransportError naming the host and the fix when there is no route."""
    try:
        found = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise TransportError(f"cannot tell which interface reaches {address}: {stdout!r}",
                             host=host) from exc
    name = found.get("interface")
    if not name:
        why = found.get("error") or "no interface found"
        raise TransportError(f"cannot tell which interface reaches {address}: {why} (name "
                             "the host's `interface:` in the spec)", host=host)
    return str(name)
