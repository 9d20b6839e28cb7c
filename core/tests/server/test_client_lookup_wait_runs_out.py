"""A LOOKUP asks the server to wait for its prefetch the whole of the lookup's timeout, and
the server answers at the end of that wait at the latest, counting it from when it read the
request, after the client started its own clock.  So the client waits for that answer past
the wait it asked for: taken for no answer, the reply would be left to settle later, and a
prefetch that finished as it came would leave its read locks held for a caller that was told
the lookup failed.  Here the prefetch never finishes within the wait: the lookup ends with
the server's answer (a prefetch still running, asked about once more), not with no reply."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

#: the storage handle the stalled prefetch is given
HANDLE = 7


@pytest.fixture
def stalled_prefetch(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[TiersServer]:
    """Every LOOKUP's prefetch goes to L2 and does not finish while the test runs."""
    storage, never = server.storage, threading.Event()

    def wait(handle: int, timeout: float) -> None:
        never.wait(timeout)  # the whole wait: the answer comes at the server's deadline

    monkeypatch.setattr(storage, "start_prefetch", lambda keys, **options: (HANDLE, None))
    monkeypatch.setattr(storage, "query_prefetch", lambda handle: None)
    monkeypatch.setattr(storage, "wait_prefetch", wait)
    monkeypatch.setattr(storage, "discard_prefetch", lambda handle: None)
    yield server
    never.set()


def test_a_lookup_whose_wait_runs_out_ends_with_the_servers_answer(stalled_prefetch: TiersServer) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(2)]
    with Client(stalled_prefetch.endpoint, timeout=30.0) as client:
        assert "lookup_wait" in client.server_features
        before = Counter(stalled_prefetch.frontend_stats()[0][1].requests)
        with pytest.raises(RequestTimeoutError, match=r"prefetch of 2 keys did not finish within 0\.2s"):
            client.lookup(keys, timeout=0.2)
        sent = Counter(stalled_prefetch.frontend_stats()[0][1].requests) - before
        assert sent == Counter({"Lookup": 1, "WaitPrefetchStatus": 1}), sent
        assert not client._orphans  # no request was given up on: every reply was read
