"""The client and the wire package stand on their own: nothing of the server is imported."""

from __future__ import annotations

import subprocess
import sys


def test_client_imports_nothing_from_the_server() -> None:
    probe = (
        "import sys\n"
        "import lmcache_tiers.client, lmcache_tiers.wire.protocol, lmcache_tiers.wire.shm\n"
        "print(sorted(name for name in sys.modules if name.startswith('lmcache_tiers.server')))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
