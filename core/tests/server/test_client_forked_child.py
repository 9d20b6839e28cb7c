"""A client inherited by a forked child refuses every call there (its socket is the
parent's, whose replies the child would take), while the parent goes on using it, and a
client made in the child works.  So whichever thread made the client or forks, with another
thread holding the client's lock at the fork, and for a client made after one fork at the
next."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.threads import DEADLINE_S, joined

# What the child reports through its exit status.
_REFUSED = 3
_NOT_REFUSED = 4
_OWN_CLIENT_FAILED = 5
_CLOSE_FAILED = 6
_OWN_CLIENT_NOT_REFUSED_IN_GRANDCHILD = 7


def _refused(client: Client, keys: list[ObjectKey]) -> bool:
    try:
        client.lookup(keys)
    except ClientError as exc:
        return "forked child" in str(exc)
    return False


def _fork_and_wait(in_child: Callable[[], int]) -> int:
    """Fork, run ``in_child`` there and leave it without the parent's clean-up; the
    child's exit code.  A child that hangs (a lock the parent held) is ended by SIGALRM
    instead of hanging the test."""
    pid = os.fork()
    if pid == 0:
        code = _NOT_REFUSED
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(DEADLINE_S))
            code = in_child()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _in_child(server: TiersServer, inherited: Client, keys: list[ObjectKey]) -> int:
    if not _refused(inherited, keys):
        return _NOT_REFUSED
    try:
        with Client(server.endpoint) as own:
            own.ping()
    except Exception:
        return _OWN_CLIENT_FAILED
    return _REFUSED


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_client_is_refused_in_a_forked_child_and_still_works_in_its_parent(server: TiersServer) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(4)]
    with Client(server.endpoint) as client:
        assert client.lookup(keys) == 0
        assert _fork_and_wait(lambda: _in_child(server, client, keys)) == _REFUSED
        assert client.lookup(keys) == 0
        client.ping()


def _in_child_of_a_thread(server: TiersServer, inherited: Client, keys: list[ObjectKey]) -> int:
    if not _refused(inherited, keys):
        return _NOT_REFUSED
    try:
        inherited.close()  # its lock was held by another thread of the parent at the fork
    except Exception:
        return _CLOSE_FAILED
    try:
        with Client(server.endpoint) as own:
            own.ping()
            # a connection made after the fork is inherited by the next fork in its turn
            if _fork_and_wait(lambda: _REFUSED if _refused(own, keys) else _NOT_REFUSED) != _REFUSED:
                return _OWN_CLIENT_NOT_REFUSED_IN_GRANDCHILD
            own.ping()
    except Exception:
        return _OWN_CLIENT_FAILED
    return _REFUSED


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_client_made_in_a_thread_is_refused_in_a_child_forked_by_another_while_a_third_holds_its_lock(
    server: TiersServer,
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(4)]
    made: list[Client] = []
    maker = threading.Thread(target=lambda: made.append(Client(server.endpoint)), daemon=True)
    maker.start()
    joined(maker, "making a client")
    (client,) = made
    with client:
        holding, release = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with client._lock:
                holding.set()
                release.wait(DEADLINE_S)

        holder = threading.Thread(target=hold_the_lock, daemon=True)
        holder.start()
        assert holding.wait(DEADLINE_S)
        codes: list[int] = []
        forker = threading.Thread(
            target=lambda: codes.append(_fork_and_wait(lambda: _in_child_of_a_thread(server, client, keys))),
            daemon=True,
        )
        try:
            forker.start()
            joined(forker, "forking", DEADLINE_S * 2)  # the child's alarm first
        finally:
            release.set()
            joined(holder, "holding the client's lock")
        assert codes == [_REFUSED]
        assert client.lookup(keys) == 0
