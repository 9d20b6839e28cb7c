"""``LockEpochs``: which keys a release leaves out, those whose newest read lock this client
took over a connection that has dropped since (``epoch``: the drops seen when the request
went out; ``drops``: the drops seen now)."""

from __future__ import annotations

import os

from lmcache_tiers.client.lock_epochs import REMEMBERED_KEYS, LockEpochs
from lmcache_tiers.keys import ObjectKey


def keys_of(count: int) -> list[ObjectKey]:
    prefix = os.urandom(8)
    return [ObjectKey("unit", 0, prefix + index.to_bytes(4, "big")) for index in range(count)]


def test_keys_locked_over_the_connection_still_up_are_all_released() -> None:
    epochs, keys = LockEpochs(), keys_of(4)
    epochs.note(keys, 0, 0)
    assert epochs.release(list(keys), 0) == (keys, 0)


def test_keys_locked_before_a_drop_are_left_out_and_counted_once_each() -> None:
    epochs, before, after = LockEpochs(), keys_of(3), keys_of(2)
    epochs.note(before, 0, 0)
    epochs.note(after, 1, 1)
    kept, left_out = epochs.release([before[0], after[0], before[0], before[1], after[1]], 1)
    assert kept == [after[0], after[1]]
    assert left_out == 2
    # Forgotten once left out: a release of them later goes by key.
    assert epochs.release([before[0], before[2]], 1) == ([before[0]], 1)
    assert epochs.release([before[0], before[2]], 1) == ([before[0], before[2]], 0)


def test_a_key_locked_again_after_the_drop_is_released() -> None:
    epochs, keys = LockEpochs(), keys_of(4)
    epochs.note(keys, 0, 0)
    epochs.note(keys[1:3], 1, 1)
    assert epochs.release(list(keys), 1) == (keys[1:3], 2)


def test_keys_locked_over_a_connection_are_left_out_after_each_later_drop() -> None:
    epochs, first, second = LockEpochs(), keys_of(2), keys_of(2)
    epochs.note(first, 0, 0)
    epochs.note(second, 1, 1)
    assert epochs.release([*first, *second], 3) == ([], 4)


def test_a_release_forgets_its_keys_locked_before() -> None:
    """A RELEASE by key drops every lock the client holds on it over that connection: a
    release of the key after a drop has none of this client's locks to leave out."""
    epochs, keys = LockEpochs(), keys_of(3)
    epochs.note(keys, 0, 0)
    assert epochs.release(keys[:2], 0) == (keys[:2], 0)
    assert epochs.release(list(keys), 1) == (keys[:2], 1)


def test_a_key_locked_again_after_its_release_is_left_out_after_a_drop() -> None:
    epochs, keys = LockEpochs(), keys_of(2)
    epochs.note(keys, 0, 0)
    epochs.release(list(keys), 0)
    epochs.note(keys[:1], 0, 0)
    assert epochs.release(list(keys), 1) == (keys[1:], 1)


def test_a_reply_read_late_leaves_out_only_keys_not_locked_over_the_newer_connection() -> None:
    """A reply to a request sent before the drop, read after requests over the next
    connection: its locks are in the dropped connection's session, except that a key
    locked over the next one since keeps that newer lock."""
    epochs, keys = LockEpochs(), keys_of(4)
    epochs.note(keys[:1], 1, 1)
    epochs.note(keys[1:2], 1, 1)
    epochs.release(keys[1:2], 1)
    epochs.note(list(keys), 0, 1)
    assert epochs.release(list(keys), 1) == (keys[:1], 3)


def test_a_reply_read_late_leaves_its_keys_out_until_they_are_locked_again() -> None:
    epochs, keys = LockEpochs(), keys_of(2)
    epochs.note(keys, 0, 0)
    epochs.note(list(keys), 0, 1)
    epochs.note(keys[:1], 1, 1)
    assert epochs.release(list(keys), 2) == ([], 2)


def test_a_reply_read_late_is_left_out_after_a_release_of_its_keys_over_the_newer_connection() -> None:
    epochs, keys = LockEpochs(), keys_of(2)
    epochs.note(keys, 1, 1)
    epochs.release(list(keys), 1)
    epochs.note(keys[:1], 0, 1)
    assert epochs.release(list(keys), 2) == (keys[1:], 1)


def test_keys_locked_before_a_drop_are_forgotten_once_as_many_keys_are_noted_after() -> None:
    epochs, old = LockEpochs(), keys_of(2)
    epochs.note(old, 0, 0)
    epochs.note(keys_of(1), 1, 1)  # the drop is taken in
    for _ in range(REMEMBERED_KEYS // 512):
        epochs.note(keys_of(512), 1, 1)
    # Released by key, as keys this client never locked.
    assert epochs.release(list(old), 1) == (old, 0)


def test_keys_noted_before_as_many_keys_as_are_remembered_are_forgotten() -> None:
    epochs, old = LockEpochs(), keys_of(2)
    epochs.note(old, 0, 0)
    for _ in range(REMEMBERED_KEYS // 512):
        epochs.note(keys_of(512), 0, 0)
    assert epochs.release(list(old), 1) == (old, 0)


def test_the_newest_lock_on_a_key_is_remembered_however_many_keys_came_before() -> None:
    epochs, key = LockEpochs(), keys_of(1)
    epochs.note(key, 0, 0)
    for _ in range(REMEMBERED_KEYS // 512 - 1):
        epochs.note(keys_of(512), 0, 0)
    epochs.note(key, 0, 0)
    epochs.note(keys_of(512), 0, 0)
    assert epochs.release(list(key), 1) == ([], 1)
