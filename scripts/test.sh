#!/usr/bin/env bash
# Install everything on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/python" -m pytest "$@"
