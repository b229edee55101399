"""Cut the bundled training corpus from this Python's standard library (PSF licence).

Run with a CPython 3.11 (``python3 make_corpus.py``); it rewrites ``corpus.txt`` and
``NOTICE.md`` next to this script. The cut, step by step:

1. Read each file of ``SOURCES`` (paths relative to ``sysconfig.get_paths()["stdlib"]``),
   in that order, as UTF-8.
2. Normalise line endings to ``\\n``, expand tabs to 4 spaces, strip trailing whitespace
   from each line, and replace every non-ASCII character with ``?``.
3. Put a header line ``# ===== Lib/<path> =====`` and a blank line before each file's
   text, and a blank line after it.
4. Join everything and cut at the last line break at or before ``TARGET_BYTES``.

Only whole files from the list are used (source code with its comments and docstrings);
nothing else is filtered out. The result is plain ASCII, one byte per token for the GPT.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import sys
import sysconfig
from pathlib import Path

SOURCES: tuple[str, ...] = (
    "textwrap.py",
    "string.py",
    "functools.py",
    "collections/__init__.py",
    "heapq.py",
    "bisect.py",
    "fractions.py",
    "random.py",
    "statistics.py",
    "contextlib.py",
    "shlex.py",
    "queue.py",
    "copy.py",
    "abc.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "argparse.py",
)
TARGET_BYTES = 400_000
HERE = Path(__file__).resolve().parent


def clean(text: str) -> str:
    """Step 2: line endings, tabs, trailing spaces, non-ASCII -> '?'."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).encode("ascii", "replace").decode("ascii")


def build(stdlib: Path, target: int = TARGET_BYTES) -> tuple[str, list[str]]:
    """Return the corpus text and the list of files that contributed to it."""
    parts: list[str] = []
    used: list[str] = []
    total = 0
    for rel in SOURCES:
        if total >= target:
            break
        body = clean((stdlib / rel).read_text(encoding="utf-8")).strip("\n")
        part = f"# ===== Lib/{rel} =====\n\n{body}\n\n"
        parts.append(part)
        used.append(rel)
        total += len(part)
    text = "".join(parts)
    if len(text) > target:
        text = text[: text.rindex("\n", 0, target) + 1]
    return text, used


def notice(stdlib: Path, text: str, used: list[str]) -> str:
    """NOTICE.md: where the text came from, how it was cut, and the PSF licence."""
    licence = (stdlib / "LICENSE.txt").read_text(encoding="utf-8").rstrip("\n")
    found = re.search(r'"(Copyright \(c\) 2001,.*?All Rights Reserved)"', licence, re.S)
    copyright_line = " ".join(found.group(1).split()) if found else "Copyright (c) PSF"
    files = "\n".join(f"{i}. `Lib/{rel}`" for i, rel in enumerate(used, 1))
    return f"""# corpus.txt: notice

`corpus.txt` is text from the source files (code, comments and docstrings) of the
Python standard library of CPython {platform.python_version()}:

> {copyright_line}

It is redistributed under the PSF License Agreement, whose full text (the
`LICENSE.txt` shipped with that Python, in its stdlib directory) is quoted below.

## How the slice was cut

`make_corpus.py` in this directory reproduces it (`python3 make_corpus.py` with a
CPython 3.11; other 3.11.x releases may differ by a few bytes). Files, in this order:

{files}

For each file: line endings normalised to `\\n`, tabs expanded to 4 spaces, trailing
whitespace stripped, every non-ASCII character replaced by `?`; a header line
`# ===== Lib/<path> =====` and a blank line put before it and a blank line after it.
The concatenation was cut at the last line break at or before {TARGET_BYTES} bytes
(so the last file listed is only partly included).
Nothing else was removed or changed.

Result: {len(text)} bytes, plain ASCII, sha256 `{hashlib.sha256(text.encode()).hexdigest()}`.

The training split (`examples/gpt/data.py`) puts every 20th 2048-byte block in the
evaluation set and the rest in the training set.

## Licence (the `LICENSE.txt` shipped with Python {platform.python_version()}, verbatim)

```
{licence}
```
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        version = platform.python_version()
        print(f"warning: made for CPython 3.11, this is {version}", file=sys.stderr)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text, used = build(stdlib)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "corpus.txt").write_text(text, encoding="ascii", newline="\n")
    (args.out_dir / "NOTICE.md").write_text(notice(stdlib, text, used), encoding="utf-8")
    print(f"corpus.txt: {len(text)} bytes from {len(used)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
