"""A native server in a pid namespace of its own (run under ``unshare --pid --fork
--mount-proc``), for a client outside it, whose pid ``SO_PEERCRED`` gives as 0 here:
``python foreign_namespace_server.py IPC_PATH``.

It starts the server on ``ipc://IPC_PATH`` and a process here mapping the arena, prints
the endpoint and that process's pid (of this namespace), then waits for a line on stdin:
the client has reserved, greeting the server with that pid.  It then expires the
reservation, ends the process the HELLO named, waits for two sweeps of the fences and
prints ``fenced <extents> foreign <connections counted>``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from native_fence_support import SHORT_TTL
from native_keys import leases_of
from native_stop import wait_for
from test_writer_kernel_pid import arena_path

from lmcache_tiers.testing.children import FILE_MAPPER, end, says
from lmcache_tiers.testing.children import start_script as start
from lmcache_tiers.testing.server import ServerHarness


def main() -> None:
    harness = ServerHarness()
    server = harness.make(host=f"ipc://{sys.argv[1]}", **SHORT_TTL)
    named: subprocess.Popen[str] | None = None
    try:
        named = start(FILE_MAPPER, arena_path(server))
        says(named, "mapped")
        print(server.endpoint, named.pid, flush=True)
        sys.stdin.readline()  # the client reserved
        wait_for(lambda: leases_of(server)["fenced_extents"] == 1, "the expired reservation fenced")
        server.storage.l1.expire_locks(time.monotonic() + 3600.0)
        end(named)
        handlers = server.frontends[0].handlers
        release, runs = handlers.release_fences_of_exited_writers, [0]

        def counted() -> None:
            release()
            runs[0] += 1

        handlers.release_fences_of_exited_writers = counted
        wait_for(lambda: runs[0] >= 2, "two sweeps of the fences")
        foreign = server.frontends[0].stats().failures["peer_foreign_namespace"]
        print("fenced", leases_of(server)["fenced_extents"], "foreign", foreign, flush=True)
    finally:
        if named is not None and named.poll() is None:
            end(named)
        harness.close()


if __name__ == "__main__":
    main()
