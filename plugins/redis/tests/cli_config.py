"""The real CLI's ``serve --print-config`` for one L2 adapter spec: what an operator's JSON
turns into, or the one line it is refused with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "lmcache-tiers"


def print_config(adapter: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), "serve", "--print-config", "--no-shm", "--l2-adapter", json.dumps(adapter)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
