"""Run one lmcache-tiers server for the end-to-end tests, the way ``serve`` does.

Usage: ``python serve_for_tests.py '<json>' READY_FILE`` where the JSON holds ``config``
(ServerConfig fields), ``adapters`` (``--l2-adapter`` objects) and ``frontends``
(``--frontend`` objects).  READY_FILE appears once
the server is listening; the process exits with run_server's exit code.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from lmcache_tiers.config import build_config
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.server.app import run_server
from lmcache_tiers.server.leave import leave_past_stuck_threads


def main() -> int:
    spec = json.loads(sys.argv[1])
    ready_file = sys.argv[2]
    registry = load_registry()
    config = build_config(
        registry,
        overrides=spec.get("config", {}),
        adapter_json=[json.dumps(adapter) for adapter in spec.get("adapters", [])],
        frontend_json=[json.dumps(frontend) for frontend in spec.get("frontends", [])],
    )
    ready = threading.Event()

    def announce() -> None:
        ready.wait()
        partial = ready_file + ".tmp"
        with open(partial, "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(partial, ready_file)

    threading.Thread(target=announce, daemon=True).start()
    code = run_server(config, registry=registry, ready=ready)
    leave_past_stuck_threads(code)  # as `serve` does
    return code


if __name__ == "__main__":
    sys.exit(main())
