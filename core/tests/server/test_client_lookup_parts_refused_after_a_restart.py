"""A lookup split into parts by the server's key limit, whose server restarts between two
parts with a lower limit: the later part, cut at the old limit, is refused (TOO_LARGE),
and the lookup is made once more on the restarted server.  The locks the earlier parts
took went with the old server: they are not released by key on the new one (where a
release could only drop this client's locks taken since), and the refused part took none.
The earlier parts' keys were released there by key, by the old limit -- refused again."""

from __future__ import annotations

from typing import Any

import pytest
from client_restarts import Factory, fresh_keys, native, restarted, stats_of, stored_by_another_client

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer

OLD_LIMIT = 4
NEW_LIMIT = 2


def test_the_parts_a_lookup_locked_before_a_restart_are_not_released_on_the_restarted_server(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_server(frontends=native(OLD_LIMIT))
    keys = fresh_keys(2 * OLD_LIMIT)
    stored_by_another_client(first, keys)
    servers: list[TiersServer] = []
    with Client(first.endpoint, timeout=30) as client:
        look_up_part = client._lookup_part

        def restart_after_the_first_part(*args: Any) -> int:
            found = look_up_part(*args)
            if not servers:
                servers.append(restarted(make_server, first, client, max_keys=NEW_LIMIT))
                stored_by_another_client(servers[0], keys)
            return found

        monkeypatch.setattr(client, "_lookup_part", restart_after_the_first_part)
        assert client.lookup(keys) == len(keys)
        monkeypatch.undo()
        second = servers[0]
        # Only the second part, cut at the old limit, was refused; nothing was released.
        assert stats_of(second).failures["too_large"] == 1
        assert stats_of(second).requests["Release"] == 0
        # The lookup made once more holds every key's lock on the restarted server.
        assert stats_of(second).locked_keys == len(keys)
        assert client.release(keys) == len(keys)
