#!/usr/bin/env bash
# Install the reference LMCache (lmcache==0.5.6, CPU) into a venv of its own, for the tests
# and benchmarks that run LMCache's client against lmcache-tiers.  Idempotent: a venv that
# already holds it is left alone.  Never fails the caller: without the package index the
# tests that need it are skipped with the reason printed.
# Usage: bash scripts/install_reference_lmcache.sh   (LMCACHE_REF_VENV=dir to choose where)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
REF=${LMCACHE_REF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/lmcache-tiers/lmcache-0.5.6}
export DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false LMCACHE_DISABLE_BANNER=1
probe='import importlib.metadata as m, lmcache.v1.multiprocess.transport.factory; assert m.version("lmcache") == "0.5.6"'
if [ -x "$REF/bin/lmcache" ] && "$REF/bin/python" -c "$probe" 2>/dev/null; then
    echo "reference LMCache 0.5.6 already in $REF"
    exit 0
fi
install() {
    mkdir -p "$(dirname "$REF")" &&
    { [ -x "$REF/bin/python" ] || "$PYTHON" -m venv "$REF"; } &&
    "$REF/bin/python" -m pip install -q --upgrade pip &&
    # torch first, pinned by constraints.txt (the CPU build), then lmcache without its deps
    "$REF/bin/python" -m pip install -q -c constraints.txt torch &&
    "$REF/bin/python" -m pip install -q -c constraints.txt --no-deps lmcache==0.5.6 &&
    "$REF/bin/python" -m pip install -q -c constraints.txt -r scripts/lmcache-0.5.6-cpu-requirements.txt &&
    "$REF/bin/python" -c "$probe"
}
if install; then
    echo "installed the reference LMCache 0.5.6 into $REF"
else
    echo "could not install the reference LMCache into $REF: the tests that run its client will be skipped"
fi
exit 0
