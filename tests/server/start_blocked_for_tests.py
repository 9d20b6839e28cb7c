"""Run ``run_server`` whose start-up blocks while building its L2 adapter, for the tests of
signals during start-up.

Usage: ``python start_blocked_for_tests.py '<json>' BLOCKED_FILE``: the JSON holds
``config`` (ServerConfig fields).  The only L2 adapter (type ``blocks_start``) is built
after L1 exists: its factory creates BLOCKED_FILE and then sleeps, as an adapter that
connects to a slow remote store would.  The process exits with run_server's exit code.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from lmcache_tiers.config import build_config
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.server.app import run_server

#: far longer than any test waits: only a signal ends the start-up
BLOCK_S = 120.0


def main() -> int:
    spec = json.loads(sys.argv[1])
    blocked_file = sys.argv[2]
    registry = load_registry()

    def blocks_start(config: Any, context: Any) -> Any:
        with open(blocked_file, "w") as handle:
            handle.write("building the L2 adapter\n")
        time.sleep(BLOCK_S)
        raise AssertionError("start-up was never interrupted")

    config_type = registry.get(Kind.L2_ADAPTER, "mock").config
    registry.for_plugin(Kind.L2_ADAPTER, "tests").add("blocks_start", blocks_start, config_type)
    config = build_config(
        registry,
        overrides=spec["config"],
        adapter_json=[json.dumps({"type": "blocks_start", "max_size_gb": 0.01})],
    )
    return run_server(config, registry=registry)


if __name__ == "__main__":
    sys.exit(main())
