#!/usr/bin/env bash
# Debian packages the test suite starts as real servers or loads as libraries:
# redis-server (the redis adapter's tests), libibverbs1/librdmacm1/libnuma1 (Mooncake's
# transfer engine); exfat-fuse/exfatprogs (an exFAT image mounted for the fs adapter's
# test of a filesystem that does not tell letter case apart); and python3-venv, without
# which Debian's python3 cannot create the .venv of scripts/install.sh. Installed only when missing and only as root; otherwise
# the tests that need them skip with a printed reason (and a missing venv module stops
# install.sh with Python's own message).
set -euo pipefail
packages=()
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v mount.exfat-fuse >/dev/null 2>&1 || packages+=(exfat-fuse)
command -v mkfs.exfat >/dev/null 2>&1 || packages+=(exfatprogs)
"${PYTHON:-python3}" -c 'import ensurepip, venv' >/dev/null 2>&1 || packages+=(python3-venv)
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do
    ldconfig -p 2>/dev/null | grep -q "$lib" || packages+=("${lib%%.so.1}1")
done
[ ${#packages[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: not root or no apt-get; missing: ${packages[*]} (their tests will skip)" >&2
    exit 0
fi
echo "system-deps: installing ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || true
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
