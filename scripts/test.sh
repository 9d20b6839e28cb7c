#!/usr/bin/env bash
# Install everything on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/install.sh
# LMCache's own client, for the tests that run it against the lmcache_mp front end
bash scripts/install_reference_lmcache.sh
VENV=${VENV:-.venv}
# Three workers, one test file each at a time (module fixtures -- a Redis, a SeaweedFS, a
# Mooncake master -- start once per file): most of the suite waits on servers it started
# (two workers kept two cores about half busy), so a third worker's files run in those
# waits, even on two cores. The ports tests give their servers come from
# lmcache_tiers.testing.ports (outside the kernel's ephemeral range, each leased to one
# process), so more workers opening connections at once cannot take one meanwhile.
# TEST_WORKERS=0 runs everything in this process; later -n/--dist arguments win.
"$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile "$@"
