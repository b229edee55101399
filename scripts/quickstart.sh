#!/usr/bin/env bash
# The quickstart: install what is needed into .venv, then launch the quickstart job on this
# machine and watch it live (Ctrl-C detaches; `nebula stop JOB` ends it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/nebula launch "${1:-templates/quickstart.yaml}"
