#!/usr/bin/env bash
# The test command: install what is needed into .venv, lint, then run every test.
# Tests that need root (network namespaces, sshd) skip with a reason when not root.
# NEBULA_TEST_WORKERS=N: N pytest-xdist workers, a test module to each at a time (its module
# fixtures made once; each worker that runs test-bed tests makes its own bed). Default 0, one
# process: with 2 workers on 2 cores the suite took 34 min here, but a relay's port
# planned at launch can be taken by another test's process before the relay binds it (the
# relay is restarted, late: CHANGELOG, Changed), so CI runs one process until that is fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
workers=${NEBULA_TEST_WORKERS:-0}
if [ "$workers" != 0 ]; then
  set -- -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest "$@"
