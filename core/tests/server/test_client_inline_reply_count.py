"""An inline RETRIEVE answered with more objects than keys asked is a protocol error, as
it is over shared memory: which payload belongs to which key cannot be told, so none is
handed out, and the locks this client holds on the keys are given back.  The extra
payloads used to be handed out as views beyond the keys asked.

No real server answers so; a fake peer (``lmcache_tiers.testing.fake_peer``) does."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.fake_peer import FakePeer, PeerReply
from lmcache_tiers.wire import protocol as p

PAYLOAD = b"\x5a" * 64


def _over_answer(request: Any) -> PeerReply | None:
    """Every inline RETRIEVE with one object more than asked."""
    if not isinstance(request, p.Retrieve):
        return None
    count = len(request.keys) + 1
    return p.RetrieveReply(request.req_id, slots=[p.Slot(0, len(PAYLOAD))] * count), [PAYLOAD] * count


@pytest.fixture
def peer() -> Iterator[FakePeer]:
    with FakePeer(_over_answer, name="over-answering-peer", hello={"max_inline_bytes": 1 << 20}) as serving:
        yield serving


@pytest.mark.parametrize("call", ["retrieve", "retrieve_into"])
def test_an_inline_retrieve_answered_with_more_objects_than_keys_fails_closed(
    peer: FakePeer, call: str
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(2)]
    with Client(peer.url, timeout=5.0) as client:
        assert not client.uses_shm
        targets = [np.zeros(len(PAYLOAD), dtype=np.uint8) for _ in keys]
        with pytest.raises(ProtocolError, match="3 slots for 2 keys"):
            if call == "retrieve":
                with client.retrieve(keys) as views:
                    pytest.fail(f"{len(views)} views handed out for {len(keys)} keys")
            else:
                client.retrieve_into(keys, targets)
        assert not any(target.any() for target in targets)
        assert peer.released == keys
