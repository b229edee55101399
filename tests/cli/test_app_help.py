"""cli/app.py's help: `nebula --help` and every command's `--help` wrap cleanly at any terminal
width. A paragraph's line ends only where the next word would not have fitted (no docstring
line break in the middle of rich's wrapped text), and nothing the text names is swallowed by
the markup (a `<id>` in a path stays)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nebula_cli.cli.app import app

COMMANDS = [[], ["validate"], ["init"], ["launch"], ["resume"], ["status"], ["logs"], ["report"],
            ["stop"], ["bench-network"], ["plan"], ["plan", "sync"], ["plan", "placement"]]
WIDTHS = (52, 80, 137)


def help_text(args: list[str], width: int) -> str:
    """What `nebula ARGS --help` prints in a terminal `width` columns wide."""
    result = CliRunner().invoke(app, [*args, "--help"],
                                env={"COLUMNS": str(width), "NO_COLOR": "1", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return result.output


def blocks(text: str) -> list[tuple[int, list[str]]]:
    """(room, lines) of every wrapped paragraph: the prose above the panels (room: the width
    inside the margins) and each entry of a Commands panel (room: its help column's width)."""
    out: list[tuple[int, list[str]]] = []
    lines = text.splitlines()
    prose: list[str] = []
    in_box = False
    entry: list[str] = []
    offset = room = 0
    for line in lines:
        if line.startswith("╭"):
            in_box, commands = True, "Commands" in line
            if prose:
                out.append((len(lines[0]) - 2, prose))
                prose = []
            continue
        if line.startswith("╰"):
            if entry:
                out.append((room, entry))
            in_box, entry = False, []
            continue
        if in_box:
            if not commands:
                continue
            inner = line[2:-2]
            if inner[:1] != " ":  # a new command's first line
                if entry:
                    out.append((room, entry))
                name_end = inner.index(" ")
                offset = name_end + len(inner[name_end:]) - len(inner[name_end:].lstrip())
                room, entry = len(inner) - offset, []
            entry.append(inner[offset:].rstrip())
            continue
        body = line.strip()
        if not body or body.startswith("Usage:"):
            if prose:
                out.append((len(lines[0]) - 2, prose))
                prose = []
            continue
        prose.append(body)
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "nebula")
def test_help_wraps_only_where_the_width_says(args: list[str], width: int) -> None:
    text = help_text(args, width)
    found = blocks(text)
    assert found, text  # something was parsed: the check ran
    for room, lines in found:
        for this, following in zip(lines, lines[1:], strict=False):
            word = following.split()[0] if following.split() else ""
            assert len(this) + 1 + len(word) > room, (
                f"a hard line break at width {width}:\n{this!r}\n{following!r}\n\n{text}")


def test_paths_in_help_keep_their_placeholders() -> None:
    text = help_text(["report"], 200)
    assert "$NEBULA_HOME/jobs/<id>/tb" in text
    assert "$NEBULA_HOME/jobs/<id>/report.html" in text
