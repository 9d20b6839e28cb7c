"""A ``commit_retrieve`` of an instance no longer registered still releases its read locks.

Client processes may share an instance id (``lmcache bench server`` uses fixed ones).
When the connection whose registration is in force unregisters it, another connection's
retrieve of that id stays pending (its client may still be copying out of its slots).
That client's ``commit_retrieve`` is then refused, as by LMCache's server, since the
instance is not registered; it used to leave the read locks to the lock TTL as well,
though it says the copy has ended.  Now they go at that commit.
"""

from __future__ import annotations

from typing import Any

from mp_counts import mp_stats
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

REG = Registration()


def one_chunk(request_id: str) -> Key:
    return Key(tokens_of(5), request_id, worker_id=0, end=CHUNK_TOKENS)


def l1(server: TiersServer) -> dict[str, Any]:
    return dict(server.storage.status()["l1"])


def test_a_refused_retrieve_commit_releases_the_connections_read_locks(mp_server: TiersServer) -> None:
    address = mp_address(mp_server)
    with MPClient(address) as reader, MPClient(address) as owner:
        shm = reader.register(REG)["shm_name"]
        owner.register(REG)  # the same id and layout: now the owner's registration
        payload = chunk_payloads(5, 1, REG.object_bytes)
        assert reader.store(one_chunk("store"), REG.instance_id, payload, shm)
        assert reader.call("prepare_retrieve", one_chunk("read").encode(), REG.instance_id)["success"]
        assert owner.call("unregister_kv_cache_engine_driven_context", REG.instance_id) is None
        assert l1(mp_server)["read_locks"] == 1  # another connection's: left alone
        assert reader.unanswered("commit_retrieve", one_chunk("read").encode(), REG.instance_id)
        assert reader.call("noop") == "OK"  # handled in order: the commit was handled before
        assert mp_stats(mp_server).failures["mp_unregistered_instance"] == 1
        assert l1(mp_server)["read_locks"] == 0
    transfers: Any = mp_server.frontends[0].handlers.transfers  # type: ignore[attr-defined]
    assert transfers.reads.count() == 0
