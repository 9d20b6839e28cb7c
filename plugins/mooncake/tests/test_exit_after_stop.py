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

# The child closes its adapter with the master hung, then ends as the test asks.
CHILD_CLOSING = textwrap.dedent(
    """
    import json, logging, os, signal, sys, time
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from mooncake_helpers import backend_of, eventually, open_adapter
    from lmcache_plugin_mooncake import MooncakeStoreConfig
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    logging.basicConfig(level=logging.INFO)
    adapter = open_adapter(MooncakeStoreConfig(**json.loads(os.environ["ADAPTER"])))
    eventually(lambda: backend_of(adapter).connection.connected, what="connected")
    os.kill(int(os.environ["MASTER_PID"]), signal.SIGSTOP)
    adapter.close()
    print("left unclosed:", adapter.stats().get("close_left_unclosed", 0), flush=True)
    """
)
# What a server's stop does after closing the adapter: core's leave path.
CHILD = CHILD_CLOSING + textwrap.dedent(
    """
    leave_past_stuck_threads(int(os.environ["LEAVE_CODE"]))
    print("the leave path returned", flush=True)
    """
)
# A tool or a test: its main thread just ends.
CHILD_ENDING = CHILD_CLOSING + 'print("main ends", flush=True)\n'


def _run_child(cluster: LocalCluster, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` against ``cluster``'s master, which it stops; resumed after the child ends."""
    master = cluster.master
    assert master is not None
    settings = cluster.adapter(key_prefix=f"test-{uuid.uuid4().hex[:12]}/", operation_timeout_s=0.5)
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
            [sys.executable, "-c", code],
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
    return child


def test_a_client_left_unclosed_at_stop_lets_the_leave_path_end_the_process_at_once(
    own_cluster: LocalCluster,
) -> None:
    child = _run_child(own_cluster, CHILD)
    # Structural, not timed: the leave path found the client's keeper thread and ended
    # the process itself (os._exit, which skips Mooncake's exit handler); it did not
    # return to a normal exit that tears the client down against the hung master.
    assert "the leave path returned" not in child.stdout, child.stdout
    assert child.returncode == LEAVE_CODE, (child.returncode, child.stderr[-3000:])
    assert "unclosed-client" in child.stderr, child.stderr[-3000:]


def test_a_process_that_is_not_a_server_is_not_kept_waiting_by_a_client_left_unclosed(
    own_cluster: LocalCluster,
) -> None:
    # The thread holding the unclosed client is not a daemon (the signal to serve's leave
    # path); a tool or a test whose main thread ends must not wait out its 60 s of retries.
    child = _run_child(own_cluster, CHILD_ENDING)
    assert "main ends" in child.stdout, child.stdout
    # Structural, not timed: the thread saw the main thread end and stopped retrying.
    assert "the process exits with a Mooncake client left unclosed" in child.stderr, child.stderr[-3000:]
    assert "stays unclosed" not in child.stderr, child.stderr[-3000:]
