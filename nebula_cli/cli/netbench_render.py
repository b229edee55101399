"""bench-network on screen: a progress bar while it runs, then the matrix of figures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from nebula_cli.cli.ui import cluster_colors
from nebula_cli.control.follow import finite


def human_rate(mbit: Any) -> str:
    """Mbit/s as a short figure: 850 kbit/s, 95.3 Mbit/s, 12.4 Gbit/s."""
    if not finite(mbit):
        return "-"
    if mbit >= 1000:
        return f"{mbit / 1000:.1f} Gbit/s"
    if mbit >= 1:
        return f"{mbit:.1f} Mbit/s" if mbit < 100 else f"{mbit:.0f} Mbit/s"
    return f"{mbit * 1000:.0f} kbit/s"


def human_ms(ms: Any) -> str:
    """Milliseconds as a short figure: 85 µs, 0.41 ms, 52.3 ms, 1.20 s."""
    if not finite(ms):
        return "-"
    if ms < 0.1:
        return f"{ms * 1000:.0f} µs"
    if ms < 10:
        return f"{ms:.2f} ms"
    return f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


def _cell(row: dict[str, Any] | None) -> Text:
    if row is None:
        return Text("-", style="dim")
    if row.get("error"):
        return Text("failed", style="bold red")
    return Text.assemble(  # short lines (at most 17 characters): three clusters fit 80 columns
        (human_rate(row.get("throughput_mbit")), "bold"), " TLS\n",
        f"{human_rate(row.get('plain_throughput_mbit'))} plain\n",
        f"rtt {human_ms(row.get('rtt_ms'))}\np95 {human_ms(row.get('rtt_p95_ms'))}",
    )


def bench_matrix(report: dict[str, Any]) -> Group:
    """Rows are sources, columns destinations; the diagonal holds the inside-cluster figures.
    Each cell: throughput over TLS and plain TCP, then the TLS round trip (median, p95), one
    figure a line, so that a value is never split from its unit at 80 columns."""
    names = list(report["clusters"])
    colors = cluster_colors(names)
    cells = {(r["a"], r["b"]): r for r in report["pairs"]}
    for name, info in report["clusters"].items():
        if info.get("intra"):
            cells[(name, name)] = info["intra"]
    table = Table(title=f"network of {report['job']}  ({report['streams']} streams, "
                        f"{report['duration_s']:g} s each way)",
                  title_justify="left", show_lines=True)
    table.add_column("from \\ to")
    for name in names:
        table.add_column(Text(name, style=colors[name]), justify="right")
    for a in names:
        table.add_row(Text(a, style=colors[a]), *(_cell(cells.get((a, b))) for b in names))
    hosts = Text("\n".join(
        f"{r['a']} -> {r['b']}: {r['src_host']} ({r['src_addr']}) -> {r['dst_host']} "
        f"({r['dst_addr']})" + _path(r) + (f"  failed: {r['error']}" if r.get("error") else "")
        for r in [*report["pairs"], *(i["intra"] for i in report["clusters"].values()
                                       if i.get("intra"))]), style="dim")
    return Group(table, hosts)


def _path(row: dict[str, Any]) -> str:
    """How the connections went: opened by the receiving side, through an SSH tunnel."""
    by = row.get("dialer")
    how = [f"dialled by {by}"] if by and by != row["a"] else []
    how += ["through an SSH tunnel"] if row.get("path") == "ssh tunnel" else []
    return f" ({', '.join(how)})" if how else ""


@contextmanager
def bench_progress(console: Console) -> Iterator[tuple[Callable[[str], None],
                                                       Callable[[str, int, int], None]]]:
    """(note, step): notes are printed above a bar that counts the pairs measured."""
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("bench-network", total=None)

    def note(message: str) -> None:
        bar.console.print(Text(message, style="dim"))

    def step(what: str, done: int, total: int) -> None:
        bar.update(task, description=what, completed=done, total=total)

    with bar:
        yield note, step
