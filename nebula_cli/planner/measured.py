"""Figures measured by `nebula bench-network`, as the planner reads them.

Assumed shape of bench-network's JSON (extra keys are ignored)::

    {"clusters": {"<name>": {"intra": {"rtt_ms": 0.2, "throughput_mbit": 9400}}},
     "pairs": [{"a": "<name>", "b": "<name>", "rtt_ms": 24.0, "throughput_mbit": 850}]}

``intra`` may be missing for a cluster whose figures are not needed (one device, or the sync
advisor). A pair may be listed in either order; listed twice, the two are averaged. One-way delay
is taken as rtt / 2 and bandwidth in Gbit/s as throughput_mbit / 1000.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nebula_cli.config.pipeline import device_id
from nebula_cli.planner.costmodel import Network, PlanError
from nebula_cli.planner.scenarios import read_json

if TYPE_CHECKING:
    from nebula_cli.config.spec import JobSpec

Figures = tuple[float, float]
"""(rtt in ms, throughput in Mbit/s)."""


def load_netbench(path: str | Path) -> dict[str, Any]:
    """Read bench-network's JSON file (the shape is checked where it is used)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a JSON object with 'clusters' and 'pairs'")
    return data


def _figures(entry: object, where: str) -> Figures:
    if not isinstance(entry, Mapping):
        raise PlanError(f"bench-network {where}: expected an object with rtt_ms and "
                        "throughput_mbit")
    out = []
    for key in ("rtt_ms", "throughput_mbit"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanError(f"bench-network {where}: {key} must be a number, found {value!r}")
        if value < 0 or (key == "throughput_mbit" and value == 0):
            raise PlanError(f"bench-network {where}: {key} must be "
                            f"{'> 0' if key == 'throughput_mbit' else '>= 0'}, found {value}")
        out.append(float(value))
    return out[0], out[1]


def intra_figures(netbench: Mapping[str, Any], cluster: str) -> Figures | None:
    """The cluster's intra-cluster figures, or None when bench-network has none."""
    clusters = netbench.get("clusters") or {}
    if not isinstance(clusters, Mapping):
        raise PlanError("bench-network 'clusters': expected an object keyed by cluster name")
    entry = clusters.get(cluster)
    if not isinstance(entry, Mapping) or entry.get("intra") is None:
        return None
    return _figures(entry["intra"], f"clusters.{cluster}.intra")


def pair_figures(netbench: Mapping[str, Any], a: str, b: str) -> Figures:
    """The figures between clusters a and b (listed in either order; averaged if twice)."""
    pairs = netbench.get("pairs")
    if not isinstance(pairs, list):
        raise PlanError("bench-network 'pairs': expected a list of {a, b, rtt_ms, "
                        "throughput_mbit}")
    found = [_figures(p, f"pairs[{i}]") for i, p in enumerate(pairs)
             if isinstance(p, Mapping) and {p.get("a"), p.get("b")} == {a, b}]
    if not found:
        raise PlanError(f"bench-network has no figures between clusters {a!r} and {b!r}")
    return (sum(f[0] for f in found) / len(found), sum(f[1] for f in found) / len(found))


def wan_link(netbench: Mapping[str, Any], clusters: Sequence[str]) -> Figures:
    """The slowest WAN figures among the clusters: (largest rtt, smallest throughput) over every
    pair, what an outer round waits for."""
    if len(clusters) < 2:
        raise PlanError("a WAN link needs at least two clusters")
    figs = [pair_figures(netbench, a, b)
            for i, a in enumerate(clusters) for b in clusters[i + 1:]]
    return max(f[0] for f in figs), min(f[1] for f in figs)


def devices_from_spec(spec: JobSpec, netbench: Mapping[str, Any]) -> Network:
    """Every slot of every host is a device, named ``<cluster>/<host>/<slot>``; devices of one
    cluster (the same host included) use that cluster's intra figures, others the pair's."""
    ids: list[str] = []
    owner: list[int] = []
    for ci, cluster in enumerate(spec.clusters):
        for host in cluster.hosts:
            for slot in range(host.slots):
                ids.append(device_id(cluster.name, host.host, slot))
                owner.append(ci)
    names = [c.name for c in spec.clusters]
    k = len(names)
    site = [[(0.0, 0.0)] * k for _ in range(k)]
    for i, name in enumerate(names):
        if owner.count(i) > 1:
            intra = intra_figures(netbench, name)
            if intra is None:
                raise PlanError(f"bench-network has no intra-cluster figures for cluster "
                                f"{name!r} ({owner.count(i)} devices need them)")
            site[i][i] = intra
        for j in range(i + 1, k):
            site[i][j] = site[j][i] = pair_figures(netbench, name, names[j])
    n = len(ids)
    delay = [[site[owner[a]][owner[b]][0] / 2 for b in range(n)] for a in range(n)]
    bw = [[site[owner[a]][owner[b]][1] / 1000 if a != b else 1.0 for b in range(n)]
          for a in range(n)]
    return Network.from_matrices(ids, delay, bw)
