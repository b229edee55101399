"""Tables fitted to the terminal: columns dropped by priority, never a value cut.

A rich `Table` that is wider than its terminal shrinks every column and cuts what no longer fits
("quick…", "SUCCE…", "1.7…"). A :class:`FittedTable` is laid out when it is drawn, for the width
it is drawn in (a terminal of 80 columns, the live view's panel): while its columns' narrowest
widths (a value that must stay whole: its whole width; text that may wrap: its longest word)
do not fit, the column of the lowest `Column.keep` goes (of equal ones, the rightmost); what
is left is drawn with nothing cut (numbers and names never wrap, text wraps at its words). A
column marked `stack` is not lost when it goes: each row's value (but an empty one or "-") is
said under the table, after the row's name. The columns and rows are typed data: the builders
in `cli.ui` say what each column is and how much it matters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

Cell = str | Text


@dataclass(frozen=True)
class Column:
    """One column of a fitted table."""

    header: str
    keep: int = 100
    """How much the column matters: the lowest goes first when the table does not fit (100:
    only when nothing else is left to drop)."""
    justify: Literal["left", "right"] = "left"
    wrap: bool = False
    """Its values are text that may wrap at their words (notes, problems); otherwise each is
    drawn whole on one line (numbers, names, states)."""
    stack: bool = False
    """When dropped, each row's value is said under the table instead of lost."""


def _text(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _narrowest(column: Column, cells: Sequence[Cell]) -> int:
    """The fewest cells the column can be drawn in with nothing cut: a wrapping column's longest
    word (its header's too), another's longest line (a header breaks at its line breaks)."""
    texts = [column.header, *(_text(c) for c in cells)]
    parts = [x for t in texts for x in (t.split() if column.wrap else t.splitlines())]
    return max((cell_len(x) for x in parts), default=0)


def _width(widths: Sequence[int], edge: bool) -> int:
    """A table's width for columns of `widths`: one cell of padding each side of each column,
    a line between columns, and the two edges when drawn."""
    return sum(w + 2 for w in widths) + max(len(widths) - 1, 0) + (2 if edge else 0)


def fitted_columns(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int,
                   edge: bool) -> list[int]:
    """The indices of the columns kept in `width` (in their order; the first always)."""
    kept = list(range(len(columns)))
    narrowest = narrowest_widths(columns, rows)
    while len(kept) > 1 and _width([narrowest[i] for i in kept], edge) > width:
        drop = min(kept[1:], key=lambda i: (columns[i].keep, -i))
        kept.remove(drop)
    return kept


def narrowest_widths(columns: Sequence[Column], rows: Sequence[Sequence[Cell]]) -> list[int]:
    """Each column's narrowest width with nothing cut."""
    return [_narrowest(c, [row[i] for row in rows]) for i, c in enumerate(columns)]


def _natural(column: Column, cells: Sequence[Cell]) -> int:
    """The column's width with nothing wrapped: its longest line."""
    lines = [x for t in (column.header, *(_text(c) for c in cells)) for x in t.splitlines()]
    return max((cell_len(x) for x in lines), default=0)


def column_widths(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], kept: list[int],
                  width: int, edge: bool) -> list[int]:
    """The widths of the `kept` columns in `width`: each at least its narrowest, the space left
    shared one cell at a time among the wrapping columns not yet at their natural width (rich's
    own layout shrinks the widest wrapping columns below their words, or crops the table)."""
    narrowest = narrowest_widths(columns, rows)
    natural = [max(_natural(c, [row[i] for row in rows]), narrowest[i])
               for i, c in enumerate(columns)]
    widths = [narrowest[i] for i in kept]
    spare = width - _width(widths, edge)
    while spare > 0:
        growing = [k for k, i in enumerate(kept) if widths[k] < natural[i]]
        if not growing:
            break
        for k in growing[:spare]:
            widths[k] += 1
        spare -= min(len(growing), spare)
    return widths


class FittedTable:
    """A table drawn in whatever width it gets, columns dropped by `Column.keep` (see the
    module). `name` picks the cells that name a row in what a stacked column says (by default
    its first)."""

    def __init__(self, columns: Sequence[Column], *, title: str | None = None,
                 show_edge: bool = True, name: Sequence[int] = (0,),
                 caption: Text | None = None) -> None:
        self.columns = list(columns)
        self.rows: list[list[Cell]] = []
        self.title = title
        self.show_edge = show_edge
        self.name = tuple(name)
        self.caption = caption

    def add_row(self, *cells: Cell) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.columns)} "
                             "columns")
        self.rows.append(list(cells))

    def table(self, width: int) -> tuple[Table, list[Text]]:
        """The rich table for `width`, and the lines of the stacked columns that went."""
        kept = fitted_columns(self.columns, self.rows, width, self.show_edge)
        widths = column_widths(self.columns, self.rows, kept, width, self.show_edge)
        table = Table(title=self.title, title_justify="left", show_edge=self.show_edge,
                      caption=self.caption, caption_justify="left")
        for i, w in zip(kept, widths, strict=True):
            c = self.columns[i]
            table.add_column(c.header, justify=c.justify, no_wrap=not c.wrap, overflow="fold",
                             width=w)
        for row in self.rows:
            table.add_row(*(row[i] for i in kept))
        stacked = []
        for i, c in enumerate(self.columns):
            if i in kept or not c.stack:
                continue
            for row in self.rows:
                if _text(row[i]).strip() not in ("", "-"):  # nothing to say
                    line = Text(" ".join(_text(row[n]) for n in self.name), style="bold")
                    stacked.append(line.append(f" {c.header}: ", style="").append(row[i]))
        return table, stacked

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table, stacked = self.table(options.max_width)
        yield table
        yield from stacked
