"""A server whose Mooncake client was left unclosed at its stop (the master hung) ends at
once after the stop, instead of in Mooncake's exit handler tearing that client down
against the hung master."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

from lmcache_plugin_mooncake.cluster import LocalCluster

from lmcache_tiers.testing.processes import wait_stopped

#: a guard against hangs, not a performance expectation
HANG_GUARD_S = 120.0
#: the exit code the child asks the leave path for
LEAVE_CODE = 7

# The child does what a server's stop does: close the adapter, then core's leave path.
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from mooncake_helpers import backend_of, eventually, open_adapter
    from lmcache_plugin_mooncake import MooncakeStoreConfig
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    adapter = open_adapter(MooncakeStoreConfig(**json.loads(os.environ["ADAPTER"])))
    eventually(lambda: backend_of(adapter).connection.connected, what="connected")
    os.kill(int(os.environ["MASTER_PID"]), signal.SIGSTOP)
    adapter.close()
    print("left unclosed:", adapter.stats().get("close_left_unclosed", 0), flush=True)
    leave_past_stuck_threads(int(os.environ["LEAVE_CODE"]))
    print("the leave path returned", flush=True)
    """
)


def test_a_client_left_unclosed_at_stop_lets_the_leave_path_end_the_process_at_once(
    own_cluster: LocalCluster,
) -> None:
    master = own_cluster.master
    assert master is not None
    settings = own_cluster.adapter(key_prefix=f"test-{uuid.uuid4().hex[:12]}/", operation_timeout_s=0.5)
    settings.pop("type")
    environment = {
        **LocalCluster.environment(),
        "TESTS_DIR": str(Path(__file__).parent),
        "ADAPTER": json.dumps(settings),
        "MASTER_PID": str(master.pid),
        "LEAVE_CODE": str(LEAVE_CODE),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD],
            env=environment,
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            check=False,
        )
        wait_stopped(master.pid, HANG_GUARD_S)  # still hung when the child ended
    finally:
        master.send_signal(signal.SIGCONT)
    assert "left unclosed: 1" in child.stdout, child.stdout + child.stderr[-3000:]
    # Structural, not timed: the leave path found the client's keeper thread and ended
    # the process itself (os._exit, which skips Mooncake's exit handler); it did not
    # return to a normal exit that tears the client down against the hung master.
    assert "the leave path returned" not in child.stdout, child.stdout
    assert child.returncode == LEAVE_CODE, (child.returncode, child.stderr[-3000:])
    assert "unclosed-client" in child.stderr, child.stderr[-3000:]
