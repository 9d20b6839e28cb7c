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


def _run_python(code: str, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``code`` run by a child Python with ``environment``, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


def _run_child(
    cluster: LocalCluster, code: str, resume_once: str | None = None, **variables: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` against ``cluster``'s master, which it stops; resumed after the child
    ends, or once the child's stderr shows a line holding ``resume_once`` (the master
    still stopped then).  ``variables``: more of the child's environment."""
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
        **variables,
    }
    try:
        if resume_once is None:
            child = _run_python(code, environment)
            wait_stopped(master.pid, HANG_GUARD_S)  # still hung when the child ended
        else:
            child = _run_python_resuming(code, environment, resume_once, master)
    finally:
        master.send_signal(signal.SIGCONT)
    assert "left unclosed: 1" in child.stdout, child.stdout + child.stderr[-3000:]
    return child


def _run_python_resuming(
    code: str, environment: dict[str, str], marker: str, master: subprocess.Popen[bytes]
) -> subprocess.CompletedProcess[str]:
    """``_run_python``, the stopped ``master`` resumed once a line of the child's stderr
    holds ``marker``: what the child does against the hung master up to that line is
    what the test checks, and the rest of its exit (Mooncake's teardown against a hung
    master: fixed HTTP timeouts of seconds) then ends at once."""
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stderr is not None
        seen: list[str] = []
        for line in child.stderr:
            seen.append(line)
            if marker in line:
                wait_stopped(master.pid, HANG_GUARD_S)  # still hung up to the marker
                master.send_signal(signal.SIGCONT)
                break
        stdout, rest = child.communicate(timeout=HANG_GUARD_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, "".join(seen) + rest)


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


# -- calls given up inside Mooncake ---------------------------------------------------------

# A deadline pool whose only call is given up and stays "inside Mooncake" (the function
# blocks as Mooncake's reconnect to a killed master does), then the process ends as the
# test asks: through serve's leave path, or by its main thread ending.
CHILD_GIVING_UP = textwrap.dedent(
    """
    import logging, os, sys, threading
    from lmcache_plugin_mooncake.calls import CallPool, CallTimeout
    from lmcache_tiers.server.leave import leave_past_stuck_threads

    logging.basicConfig(level=logging.INFO)
    pool = CallPool("0:mooncake_store", 1, exit_wait_s=float(os.environ["EXIT_WAIT_S"]))
    stuck_for_good = threading.Event()
    exit_waits = threading.Event()

    class ExitWaitSeen(logging.Handler):
        def emit(self, record):
            if "given up inside Mooncake to end" in record.getMessage():
                exit_waits.set()

    logging.getLogger().addHandler(ExitWaitSeen())

    def inside_mooncake():
        if os.environ["CALL"] == "ends-after-main":
            # Out of Mooncake once the process's exit is waiting for it (never without).
            threading.main_thread().join()
            exit_waits.wait()
            print("the given-up call ended", flush=True)
        else:
            stuck_for_good.wait()

    try:
        pool.run("probe", 0.05, inside_mooncake)
    except CallTimeout:
        print("given up", flush=True)
    if os.environ["END"] == "leave":
        leave_past_stuck_threads(int(os.environ["LEAVE_CODE"]), linger_s=0.2)
        print("the leave path returned", flush=True)
    """
)


def _run_giving_up(call: str, end: str, exit_wait_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "CALL": call,
        "END": end,
        "EXIT_WAIT_S": str(exit_wait_s),
        "LEAVE_CODE": str(LEAVE_CODE),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    child = _run_python(CHILD_GIVING_UP, environment)
    assert "given up" in child.stdout, child.stdout + child.stderr[-3000:]
    return child


def test_the_leave_path_ends_the_process_at_once_while_a_given_up_call_is_inside_mooncake() -> None:
    # A daemon thread returning from Mooncake while the interpreter finalizes aborts the
    # process ('terminate called without an active exception'): serve's leave path sees
    # the given-up call (a non-daemon thread waits for it) and ends the process itself.
    child = _run_giving_up("stuck", "leave")
    assert "the leave path returned" not in child.stdout, child.stdout
    assert child.returncode == LEAVE_CODE, (child.returncode, child.stderr[-3000:])
    assert "mooncake-0:mooncake_store-given-up-calls" in child.stderr, child.stderr[-3000:]


def test_a_process_ending_waits_for_a_given_up_call_to_leave_mooncake() -> None:
    # A tool or a test: its exit waits for the call to come back out of Mooncake before
    # the interpreter finalizes, instead of racing it.
    child = _run_giving_up("ends-after-main", "main")
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "the given-up call ended" in child.stdout, child.stdout + child.stderr[-3000:]
    assert "waits up to 60s for 1 call given up inside Mooncake" in child.stderr, child.stderr[-3000:]


def test_a_process_ending_does_not_wait_for_good_for_a_call_stuck_in_mooncake() -> None:
    child = _run_giving_up("stuck", "main", exit_wait_s=0.2)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "calls given up still inside Mooncake after 0.2s: 1" in child.stderr, child.stderr[-3000:]


def test_a_process_that_is_not_a_server_ends_past_a_client_left_unclosed_and_its_master_query(
    own_cluster: LocalCluster,
) -> None:
    # One child (a hung master and a process exit cost seconds each) for two things a tool
    # or a test whose main thread ends is owed.  The query a close sends the hung master
    # before closing is given up at operation_timeout_s; Mooncake's RPC timeout (set long
    # by the operator here) keeps it inside when the main thread ends: the exit waits for
    # it, as for the pool's calls.
    # The master resumed once the exit waits for the query: what is checked below is
    # settled by then, against the hung master (the main thread has ended, which is all
    # the keeper thread looks at); the rest of the exit would only wait out the query's
    # bound and Mooncake's teardown timeouts against the hung master (about 15 s).
    child = _run_child(
        own_cluster,
        CHILD_ENDING,
        resume_once="close-probe: the process waits up to",
        MC_RPC_TIMEOUT_MS="60000",
    )
    assert "main ends" in child.stdout, child.stdout
    assert "close-probe: the process waits up to" in child.stderr, child.stderr[-3000:]
    # The thread holding the unclosed client is not a daemon (the signal to serve's leave
    # path); the exit must not wait out its 60 s of retries.  Structural, not timed: the
    # thread saw the main thread end and stopped retrying (with this RPC timeout, a retry
    # it made instead would ask the hung master and stay inside Mooncake for a minute).
    assert "the process exits with a Mooncake client left unclosed" in child.stderr, child.stderr[-3000:]
    assert "stays unclosed" not in child.stderr, child.stderr[-3000:]
