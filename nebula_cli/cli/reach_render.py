"""What `nebula validate --hosts` shows of the relays' reach: per pair of clusters, each way
tried (`control.reachcheck`) and the plan's, and what to change when the plan's does not work."""

from __future__ import annotations

from rich.text import Text

from nebula_cli.cli.fit import Column, FittedTable
from nebula_cli.control.reachcheck import DIRECT, TUNNEL, PairCheck, ReachReport, Way


def _cell(way: Way) -> Text:
    if way.works is None:
        return Text("-", style="dim")
    return Text(("✓ " if way.works else "✗ ") + way.said, style="green" if way.works else "red")


def reach_table(report: ReachReport) -> FittedTable:
    """One row per pair of clusters: a -> b and b -> a, directly and over SSH, then the
    plan's way (see `reach`); what was said wraps at its words (`cli.fit`)."""
    table = FittedTable([Column("pair"), *(Column(way, keep=90, wrap=True, stack=True) for way in
                                           ("a → b", "b → a", "a → b by SSH", "b → a by SSH")),
                         Column("the plan", keep=95, wrap=True)],
                        title="relays: which way each pair can connect", show_edge=False)
    for p in report.pairs:
        table.add_row(
            str(p), _cell(p.way(p.a, p.b, DIRECT)), _cell(p.way(p.b, p.a, DIRECT)),
            _cell(p.way(p.a, p.b, TUNNEL)), _cell(p.way(p.b, p.a, TUNNEL)), _plan(p))
    return table


def _plan(p: PairCheck) -> Text:
    way = p.planned
    text = str(p.link) + {True: ": works", False: ": fails", None: ""}[way.works]
    return Text(text, style={True: "green", False: "red", None: ""}[way.works])


def reach_problems(report: ReachReport) -> list[str]:
    """The plan's ways that failed, and the `relay_reach` that would work (if one does)."""
    out = list(report.problems)
    if out and report.suggestion:
        change = ", ".join(f"{c}: relay_reach: {r}" for c, r in report.suggestion.items())
        out.append(f"every pair would connect with {change}")
    elif out:
        out.append("no relay_reach connects every pair with the ways that worked")
    return out
