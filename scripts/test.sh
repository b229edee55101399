#!/usr/bin/env bash
# The test command: install what is needed into .venv, lint, then run every test.
# Tests that need root (network namespaces, sshd) skip with a reason when not root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
