"""The clusters' colours, one list for every view: the live view, `status` and `bench-network`
draw a cluster in a terminal colour (rich's name), `nebula report` in the same hue on a white
page (a darker shade of it, so that yellow and cyan lines stay readable). A cluster's colour
comes from its place in the job's order of clusters, so east is the same colour everywhere."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Colour:
    terminal: str
    """rich's colour name (the live view, tables)."""
    page: str
    """The same hue as an RGB hex string for matplotlib (the report)."""


PALETTE = (
    Colour("cyan", "#0097a7"),
    Colour("magenta", "#b000b5"),
    Colour("green", "#2e7d32"),
    Colour("yellow", "#b59a00"),
    Colour("blue", "#1565c0"),
    Colour("red", "#c62828"),
    Colour("bright_cyan", "#00bcd4"),
    Colour("bright_magenta", "#e040fb"),
)


def cluster_colours(clusters: Iterable[str]) -> dict[str, Colour]:
    """Each cluster's colour, by its place in `clusters` (the job's order)."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(clusters)}
