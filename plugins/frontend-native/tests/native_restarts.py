"""Helpers of the tests of a client across drops, restarts and replies it gave up on."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p


def reserved_by_another_thread(client: Client, keys: Sequence[ObjectKey], size: int) -> list[p.Slot]:
    """Another thread of ``client`` greets the server it now reaches and reserves ``keys``
    there (``size`` bytes each), its copy still to come; its slots."""
    client._follow_server()
    slots = client._call(p.StoreReserve(0, "", list(keys), [size] * len(keys)), p.StoreReserveReply).slots
    assert all(slot.offset != p.NO_SLOT for slot in slots)
    return slots


def copied_and_committed_by_that_thread(
    client: Client,
    slots: Sequence[p.Slot],
    keys: Sequence[ObjectKey],
    buffers: Sequence[np.ndarray[Any, Any]],
) -> None:
    """The thread that reserved ``slots`` still holds them: it copies ``buffers`` in and
    commits them, and ``client`` then retrieves exactly ``buffers``."""
    current = client._segment
    assert current is not None
    for slot, buffer in zip(slots, buffers, strict=True):
        current.write(slot.offset, buffer)
    assert client._call(p.StoreCommit(0, "", list(keys)), p.StoreReply).done == [True] * len(keys)
    targets = [np.zeros_like(buffer) for buffer in buffers]
    assert client.retrieve_into(keys, targets) == len(keys)
    for target, buffer in zip(targets, buffers, strict=True):
        assert np.array_equal(target, buffer)


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
