"""Helpers of the tests of a client across drops, restarts and replies it gave up on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p


def until_the_drop_is_seen(client: Client) -> None:
    """Wait until ``client`` has read its connection's drop from the connection events."""
    deadline = time.monotonic() + 30
    while True:
        with client._lock:
            client._read_link_events()
            if client._unlinked:
                return
        assert time.monotonic() < deadline, "the client never saw its connection drop"
        time.sleep(0.01)


def given_up_reply(client: Client, request: p._Request) -> list[Any]:
    """Send ``request`` and give it up, as a timeout does; its reply is taken off the
    socket here, unread by the client, to be handed to it later (``_early_or_settle``)."""
    with client._lock:
        client._start(request, (), time.monotonic() + 30)
        client._give_up(request)
        frames = client._receive(30, False)
    assert frames is not None, "the server never answered"
    assert p.reply_decoder.decode(frames[0]).req_id == request.req_id
    return frames


def assert_stored_there(
    endpoint: str, keys: Sequence[ObjectKey], buffers: Sequence[np.ndarray[Any, Any]]
) -> None:
    """A reader of the server at ``endpoint`` retrieves exactly ``buffers`` under ``keys``."""
    with Client(endpoint, timeout=30) as reader:
        targets = [np.zeros_like(buffer) for buffer in buffers]
        assert reader.retrieve_into(keys, targets) == len(keys)
    for target, buffer in zip(targets, buffers, strict=True):
        assert np.array_equal(target, buffer)
