#!/usr/bin/env bash
# Install everything on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/install.sh
# LMCache's own client, for the tests that run it against the lmcache_mp front end
bash scripts/install_reference_lmcache.sh
VENV=${VENV:-.venv}
# Two workers, one test file each at a time (module fixtures -- a Redis, a SeaweedFS, a
# Mooncake master -- start once per file): most of the suite waits on servers it started,
# so two workers finish in well under the time of one, even on two cores.
# TEST_WORKERS=0 runs everything in this process; later -n/--dist arguments win.
"$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
