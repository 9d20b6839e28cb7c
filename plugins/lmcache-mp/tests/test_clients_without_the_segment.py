"""An LMCache client that cannot map the L1 segment (containers that share no /dev/shm,
the case LMCache's ``--isolated-ipc`` is for) sends its chunks pickled inside
``commit_store``.  The front end takes them only with ``"allow_pickle": true``; without
it every such store is refused (answered false, counted), so docs/lmcache-compat.md says
so where it tells what ``--isolated-ipc`` does here, not only that the client falls back
by itself."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from mp_counts import mp_stats
from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, pickled_chunks, tokens_of

from lmcache_tiers.server.app import TiersServer

COMPAT = Path(__file__).resolve().parents[3] / "docs" / "lmcache-compat.md"
REG = Registration()


def test_a_client_without_the_segment_stores_only_where_pickled_chunks_are_allowed(
    make_mp_server: Callable[..., TiersServer],
) -> None:
    pytest.importorskip("torch", reason="LMCache's clients pickle torch tensors")
    payloads = chunk_payloads(3, 4, REG.object_bytes)
    key = Key(tokens_of(3), "isolated", worker_id=0)
    for allow_pickle, stored in ((False, False), (True, True)):
        server = make_mp_server(allow_pickle=allow_pickle)
        with MPClient(mp_address(server)) as client:
            client.register(REG)  # the segment it names is never mapped
            reply = client.call("commit_store", key.encode(), REG.instance_id, pickled_chunks(payloads))
            assert reply is stored
            assert client.lookup(Key(tokens_of(3), "after")) == (4 if stored else 0)
        assert mp_stats(server).failures["mp_pickle_refused"] == (0 if stored else 1)


def test_the_compat_table_says_pickled_chunks_need_allow_pickle() -> None:
    (row,) = re.findall(r"^\| `--isolated-ipc` \|.*$", COMPAT.read_text(), flags=re.MULTILINE)
    assert '`"allow_pickle": true`' in row and "refused" in row
