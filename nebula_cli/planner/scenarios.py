"""Networks to place on: the paper's two benchmark scenarios, seeded synthetic ones, and a devices
JSON file (``{"devices": [ids], "delay_ms": [[...]], "bandwidth_gbps": [[...]]}``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nebula_cli.planner.costmodel import Network, PlanError, Task, check_memory

JSON_EXPANSION = 8
"""Bytes of parsed Python objects per byte of a devices JSON file (floats in lists), about."""

Link = tuple[float, float]
"""(delay in ms, bandwidth in Gbit/s)."""


@dataclass(frozen=True)
class Scenario:
    """A network, a task shape, and the paper's final score on it (if it has one)."""

    name: str
    title: str
    network: Network
    task: Task
    paper_score: float | None = None


def sites_network(sites: Mapping[str, int], intra: Mapping[str, Link],
                  cross: Mapping[tuple[str, str], Link]) -> Network:
    """Devices ``<site>-<i>``, site after site; pairs in a site use intra[site], pairs across
    use cross[(a, b)] (either order)."""
    names = [f"{site}-{i}" for site, count in sites.items() for i in range(count)]
    where = np.array([k for k, count in enumerate(sites.values()) for _ in range(count)])
    order = list(sites)
    s = len(order)
    delay, bw = np.zeros((s, s)), np.zeros((s, s))
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            link = intra[a] if i == j else cross.get((a, b)) or cross.get((b, a))
            if link is None:
                raise PlanError(f"no figures between sites {a!r} and {b!r}")
            delay[i, j], bw[i, j] = link
    return Network.from_matrices(names, delay[where][:, where], bw[where][:, where])


def two_datacentres() -> Scenario:
    """The paper's "multi universities" case: Ohio and Virginia, 32 devices each."""
    net = sites_network({"ohio": 32, "virginia": 32},
                        {"ohio": (1, 5), "virginia": (1, 5)},
                        {("ohio", "virginia"): (11, 1.12)})
    return Scenario("two-datacentres", "two data centres (Ohio, Virginia)", net,
                    Task(stages=8, dp=8, activation_gb=0.28125, gradient_gb=1.0), 14.75)


def regional_us() -> Scenario:
    """The paper's "regional geo-distributed" case: 16 devices in each of four US regions."""
    regions = ("virginia", "oregon", "california", "ohio")
    net = sites_network(
        dict.fromkeys(regions, 16), dict.fromkeys(regions, (5, 2)),
        {("virginia", "oregon"): (67, 1.15), ("virginia", "california"): (59, 1.05),
         ("virginia", "ohio"): (11, 1.12), ("oregon", "california"): (12, 1.25),
         ("oregon", "ohio"): (49, 1.10), ("california", "ohio"): (52, 1.02)})
    return Scenario("regional-us", "regional US (VA, OR, CA, OH)", net,
                    Task(stages=8, dp=8, activation_gb=0.4, gradient_gb=0.7), 31.42)


PAPER_SCENARIOS = {"two-datacentres": two_datacentres, "regional-us": regional_us}


def random_sites(sites: int = 3, per_site: int = 8, stages: int = 4, seed: int = 0) -> Scenario:
    """A seeded heterogeneous network nobody tuned for: sites with their own intra-site figures,
    random figures between sites, and +-20 % noise on every device pair."""
    rng = np.random.default_rng(seed)
    n = sites * per_site
    if n % stages:
        raise PlanError(f"{n} devices do not split into {stages} stages")
    site_delay = rng.uniform(10, 120, (sites, sites))
    site_bw = rng.uniform(0.3, 1.5, (sites, sites))
    np.fill_diagonal(site_delay, rng.uniform(0.5, 5, sites))
    np.fill_diagonal(site_bw, rng.uniform(2, 10, sites))
    where = np.repeat(np.arange(sites), per_site)
    delay = site_delay[where][:, where] * rng.uniform(0.8, 1.2, (n, n))
    bw = site_bw[where][:, where] * rng.uniform(0.8, 1.2, (n, n))
    names = [f"s{where[i]}-{i % per_site}" for i in range(n)]
    task = Task(stages=stages, dp=n // stages, activation_gb=float(rng.uniform(0.1, 0.5)),
                gradient_gb=float(rng.uniform(0.5, 1.5)))
    return Scenario(f"random-{sites}x{per_site}-seed{seed}",
                    f"{sites} random sites x {per_site} devices (seed {seed})",
                    Network.from_matrices(names, delay, bw), task)


def load_devices(path: str | Path) -> Network:
    """A devices JSON file: ``{"devices": [ids], "delay_ms": [[...]], "bandwidth_gbps":
    [[...]]}``, ids strings or integers, matrices N x N in that order."""
    try:
        size = Path(path).stat().st_size
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror or exc}") from exc
    check_memory(JSON_EXPANSION * size, f"{path} ({size / 2**20:.0f} MiB)")
    return network_from_json(read_json(path), str(path))


def read_json(path: str | Path) -> Any:
    """A JSON file's contents; an unreadable or invalid file is a PlanError naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise PlanError(f"{path} is not valid JSON: {exc}") from exc


def network_from_json(data: object, where: str = "devices") -> Network:
    """Validate the devices JSON shape (see `load_devices`)."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object with devices, delay_ms and "
                        "bandwidth_gbps")
    missing = [k for k in ("devices", "delay_ms", "bandwidth_gbps") if k not in data]
    if missing:
        raise PlanError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(data) - {"devices", "delay_ms", "bandwidth_gbps"})
    if unknown:
        raise PlanError(f"{where}: unknown key(s) {', '.join(unknown)}")
    ids = data["devices"]
    if not isinstance(ids, list) or not all(
            isinstance(d, (str, int)) and not isinstance(d, bool) for d in ids):
        raise PlanError(f"{where}: devices must be a list of strings or integers")
    try:
        return Network.from_matrices(ids, data["delay_ms"], data["bandwidth_gbps"])
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from exc
