"""A lookup sent by the key limit of the server greeted before, to one restarted at the
address with a lower limit since (the restart came right after the call's look at the
connection), is refused as TOO_LARGE: the call greets the restarted server and goes by
its limit once more, within its own timeout -- ``lookup`` did, ``lookup_many`` and
``start_lookup`` raised the refusal, and ``lookup`` greeted within the client's timeout."""

from __future__ import annotations

from typing import Any

import pytest
from client_restarts import Factory, fresh_keys, native, restarted, stats_of, stored_by_another_client

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.client_restarts import greeting_bounds

OLD_LIMIT = 4
NEW_LIMIT = 2
CLIENT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 20.0


@pytest.mark.parametrize("call", ["lookup", "lookup_many", "start_lookup"])
def test_a_lookup_refused_by_a_server_restarted_after_its_look_goes_by_the_new_limit(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    first = make_server(frontends=native(OLD_LIMIT))
    keys = fresh_keys(OLD_LIMIT)
    servers: list[TiersServer] = []
    with Client(first.endpoint, timeout=CLIENT_TIMEOUT_S) as client:
        follow = client._follow_server_for_limits

        def restart_after_the_look(*args: Any) -> None:
            follow(*args)
            if not servers:
                servers.append(restarted(make_server, first, client, max_keys=NEW_LIMIT))
                stored_by_another_client(servers[0], keys)

        monkeypatch.setattr(client, "_follow_server_for_limits", restart_after_the_look)
        greetings = greeting_bounds(client, monkeypatch)
        if call == "lookup":
            assert client.lookup(keys, timeout=CALL_TIMEOUT_S) == len(keys)
        elif call == "lookup_many":
            assert client.lookup_many([keys], timeout=CALL_TIMEOUT_S) == [len(keys)]
        else:
            # Over the restarted server's limit: refused as a call that knew it is.
            with pytest.raises(ValueError, match=f"at most {NEW_LIMIT} keys"):
                client.start_lookup(keys)
        monkeypatch.undo()
        assert client.max_keys == NEW_LIMIT
        assert greetings, "the restarted server was not greeted"
        if call != "start_lookup":  # bounded by the client's timeout: it has none of its own
            assert max(greetings) <= CALL_TIMEOUT_S
            assert client.release(keys) == len(keys)
        second = servers[0]
    assert stats_of(second).failures["too_large"] == 1
