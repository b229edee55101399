#!/usr/bin/env bash
# The test command: install what is needed into .venv, lint, then run every test.
# Tests that need root (network namespaces, sshd) skip with a reason when not root.
# Two pytest-xdist workers (NEBULA_TEST_WORKERS; 0: none), a test module to one of them (its
# module fixtures made once), the modules with test-bed and slow tests first (tests/conftest.py);
# each worker that runs test-bed tests makes its own bed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n "${NEBULA_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
