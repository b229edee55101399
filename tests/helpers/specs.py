"""Writing spec files in a test and reading SpecErrors: a base spec, `write`, `one` (the one
error), `problems` and `where` (its file:line:col)."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from nebula_cli.config.spec import (
    load_spec,
)
from nebula_cli.errors import SpecError

BASE = """\
name: demo
run: echo hi
clusters:
  - name: east
    hosts:
      - host: e1
        slots: 2
      - e2
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(dedent(text))
    return path


def problems(tmp_path: Path, text: str) -> list[SpecError]:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.problems, "a SpecError from load_spec always lists its problems"
    for p in info.value.problems:
        assert p.file == str(path)
    return info.value.problems


def one(tmp_path: Path, text: str) -> SpecError:
    found = problems(tmp_path, text)
    assert len(found) == 1, [str(p) for p in found]
    return found[0]


def where(p: SpecError) -> tuple[int | None, int | None, str | None]:
    return p.line, p.col, p.field
