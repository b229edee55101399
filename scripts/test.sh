#!/usr/bin/env bash
# The test command: install what is needed into .venv, lint, then run every test.
# Tests that need root (network namespaces, sshd) skip with a reason when not root.
# NEBULA_TEST_WORKERS=N: N pytest-xdist workers, a test module to each at a time (its module
# fixtures made once; each worker that runs test-bed tests makes its own bed); 0: one process.
# Default 2 on a machine of 2 cores or more, else 0 (on 2 cores, 4 workers were no faster than
# 2 and timing tests failed under the load: CHANGELOG, Changed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
if [ "$(nproc)" -ge 2 ]; then default_workers=2; else default_workers=0; fi
workers=${NEBULA_TEST_WORKERS:-$default_workers}
if [ "$workers" != 0 ]; then
  set -- -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
