#!/usr/bin/env bash
# Create (or reuse) .venv at the repository root and install nebula into it:
# torch's CPU build first (so pip never pulls a multi-GB CUDA build), then the project
# with its dev extras. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # override for another platform or torch build
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  "${PIP[@]}" install "$TORCH_SPEC"
fi
stamp=.venv/.nebula-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
   || ! .venv/bin/python -c 'import nebula_cli, deepspeed' 2>/dev/null; then
  "${PIP[@]}" install -e '.[dev]'
  touch "$stamp"
fi
