#!/usr/bin/env python3
"""Print the "Every module" section of docs/architecture.md: each folder of nebula_cli/ with each
of its modules and the first sentence of the module's docstring (its one job).

    python3 scripts/list-modules.py > /tmp/modules.md   # then paste over the section

tests/test_architecture.py fails when the section names a module that is gone or misses one;
this prints a starting point for the new lines (edit the wording there, not here)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nebula_cli"


def one_job(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split())
    m = re.match(r"(.+?\.)(\s|$)", text)
    return (m.group(1) if m else text).rstrip(".") or "(no docstring)"


def main() -> int:
    print("## Every module")
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        if "__pycache__" in folder.parts:
            continue
        modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
        if not modules:
            continue
        print(f"\n### `{folder.relative_to(PACKAGE.parent)}/`")
        for p in modules:
            print(f"- `{p.name}`: {one_job(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
