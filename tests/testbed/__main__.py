"""Manual use: `python -m tests.testbed up|down|status` (as root, from the repository root).

    up [--clusters east=e1,e2 west=w1,w2] [--north] [--rate MBIT|none] [--link pair|cluster]
       [--tcp reno] [--no-bastion]
        build a bed that outlives this command and print how to log in
    down [ID ...]   tear down the given beds (default: every bed, manual or stale)
    status          list the beds recorded under /tmp/nebula-testbed
"""

from __future__ import annotations

import argparse
import json
import sys

from .bed import DEFAULT_CLUSTERS, LINK_MODES, TestBed
from .registry import STATE_ROOT, cleanup_stale, destroy, is_stale, read_states
from .system import TestBedError, list_namespaces


def parse_clusters(items: list[str]) -> dict[str, list[str]]:
    clusters = {}
    for item in items:
        name, _, hosts = item.partition("=")
        if not name or not hosts:
            raise SystemExit(f"--clusters wants name=host,host...; got {item!r}")
        clusters[name] = hosts.split(",")
    return clusters


def cmd_up(args: argparse.Namespace) -> int:
    clusters = parse_clusters(args.clusters) if args.clusters else dict(DEFAULT_CLUSTERS)
    if args.north:
        clusters["north"] = ["n1", "n2"]
    rate = None if args.rate.lower() == "none" else float(args.rate)
    bed = TestBed(clusters, rate_mbit=rate, bastion=not args.no_bastion, tcp=args.tcp,
                  **({"link": args.link} if args.link else {})).up()
    bed.keep_after_exit()
    print(json.dumps(bed.status(), indent=1))
    first = next(iter(bed.hosts))
    print(f"\nbed {bed.id} is up. Log in with:\n  ssh -F {bed.ssh_config} {first}")
    if bed.bastion:
        print(f"  ssh -F {bed.ssh_config} {first}-jump   (through the bastion)")
    print(f"Run inside a host: ip netns exec {bed.hosts[first].ns} <cmd>")
    print(f"Tear down: python -m tests.testbed down {bed.id}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if not args.ids:
        removed = cleanup_stale(include_manual=True)
        print("removed: " + (" ".join(removed) or "nothing"))
        return 0
    states = read_states()
    for bed_id in args.ids:
        state = states.get(bed_id, {})
        destroy(bed_id, dirs=[p for p in [state.get("dir")] if p])
        print(f"removed {bed_id}")
    return 0


def cmd_status(_: argparse.Namespace) -> int:
    states = read_states()
    if not states:
        print(f"no test beds recorded under {STATE_ROOT}")
    namespaces = list_namespaces()
    for bed_id, state in states.items():
        kind = "manual" if state.get("manual") else ("stale" if is_stale(state) else "live")
        count = sum(ns.startswith(f"{bed_id}-") for ns in namespaces)
        print(f"{bed_id}  {kind}  slot {state.get('slot')}  {count} namespaces  "
              f"ssh -F {state.get('ssh_config')} <host>")
        for name, (cluster, address) in state.get("hosts", {}).items():
            print(f"    {name:10} {cluster or '-':8} {address}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a bed that stays up")
    up.add_argument("--clusters", nargs="+", metavar="NAME=H1,H2")
    up.add_argument("--north", action="store_true", help="add cluster north (n1, n2)")
    up.add_argument("--rate", default="100", help="Mbit/s between clusters, or none")
    up.add_argument("--link", choices=LINK_MODES, default=None,
                    help="a shaped link per pair of clusters (the default), or one line per "
                         "cluster")
    up.add_argument("--tcp", default=None,
                    help="the hosts' TCP congestion control (default: this machine's)")
    up.add_argument("--no-bastion", action="store_true")
    down = sub.add_parser("down", help="tear beds down")
    down.add_argument("ids", nargs="*")
    sub.add_parser("status", help="list beds")
    args = parser.parse_args(argv)
    ok, reason = TestBed.available()
    if not ok:
        print(f"test bed unavailable: {reason}", file=sys.stderr)
        return 2
    try:
        return {"up": cmd_up, "down": cmd_down, "status": cmd_status}[args.command](args)
    except TestBedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
