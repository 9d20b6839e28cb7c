"""The fake native server of the client tests says why it stopped answering: an answer of
the test's that raised ended its serving thread, and the test saw only its client waiting
for a reply that never came."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.fake_peer import FakePeer, PeerReply
from lmcache_tiers.wire import protocol as p


def _broken_answer(request: Any) -> PeerReply | None:
    if isinstance(request, p.Lookup):
        raise RuntimeError("the test's answer broke")
    return None


def test_an_answer_that_raised_is_raised_again_when_the_peer_closes() -> None:
    peer = FakePeer(_broken_answer, name="broken-answer-peer")
    try:
        with Client(peer.url, timeout=1.0) as client, pytest.raises(RequestTimeoutError):
            client.lookup([ObjectKey("unit", 0, os.urandom(8))])  # never answered
    finally:
        with pytest.raises(AssertionError, match="stopped serving") as stopped:
            peer.close()
    assert isinstance(stopped.value.__cause__, RuntimeError)
    assert str(stopped.value.__cause__) == "the test's answer broke"
