"""Long request ids count against ``max_remembered_mb``.

Request ids are the clients' choice, up to an argument frame (64 MiB) long, and the
front end keeps one per remembered request (for its status queries, its next call),
up to ``max_requests`` of them.  Their tokens, hashes and lookup keys were bounded in
memory, but not their ids: a client sending lookups under long ids made the server keep
every one of them.  An id's bytes beyond what an id usually takes now count with the
rest, and the least recently seen requests are forgotten beyond the bound, as for long
token lists.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import Key, MPClient, mp_address, tokens_of

#: each id about half of max_remembered_mb (1 MiB)
ID_CHARS = 400_000
LOOKUPS = 8


def test_requests_with_long_ids_are_forgotten_beyond_max_remembered_mb(make_mp_server: Any) -> None:
    server = make_mp_server(max_remembered_mb=1)
    requests = server.frontends[0].shared.requests
    with MPClient(mp_address(server)) as client:
        for number in range(LOOKUPS):
            request_id = f"{number}-" + "x" * ID_CHARS
            # a model nobody registered: 0 hits, but the request is remembered
            assert client.lookup(Key(tokens_of(number), request_id, model_name="nobody")) == 0
        assert len(requests) <= 2  # what fits in 1 MiB, and the request being served
        assert requests.remembered_bytes <= 2 * ID_CHARS + 4096
        assert mp_stats(server).failures["mp_request_dropped_memory"] >= LOOKUPS - 2
