"""A lookup tells the listeners the key objects L1 holds, not the caller's equal copies.

Every LOOKUP's keys are decoded afresh, so they are equal to the keys L1 and its eviction
policy hold but never the same objects: a policy finding a caller's key in its dict
compares it field by field, while it finds its own key by identity first."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096


class ReadKeys:
    def __init__(self) -> None:
        self.read: list[list[ObjectKey]] = []

    def on_l1_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_l1_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        self.read.append(list(keys))

    def on_l1_keys_deleted(self, keys: Sequence[ObjectKey]) -> None:
        pass


def fresh_keys(indices: range) -> list[ObjectKey]:
    """Keys equal to those of ``indices`` but objects of their own, as a request decodes them."""
    return [ObjectKey("model", 0, bytes(index.to_bytes(4, "big") * 4), 0, "salt") for index in indices]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(64 * ALIGN, align=ALIGN, lock_ttl_s=30.0, prefault=False)
    yield manager
    manager.close()


@pytest.mark.parametrize("until_repeat", [False, True])
def test_a_lookup_tells_listeners_the_keys_l1_holds(l1: L1Manager, until_repeat: bool) -> None:
    stored = fresh_keys(range(8))
    reserved = l1.reserve_write(stored, [ALIGN] * len(stored))
    assert all(l1.finish_write(list(reserved)))
    listener = ReadKeys()
    l1.add_listener(listener)

    wanted = fresh_keys(range(6))
    objects = l1.reserve_read_prefix(wanted, until_repeat=until_repeat)
    # Again with the same keys (the remembered hit) and with keys past the stored ones.
    again = l1.reserve_read_prefix(fresh_keys(range(6)), until_repeat=until_repeat)
    longer = l1.reserve_read_prefix(fresh_keys(range(4, 12)), until_repeat=until_repeat)

    assert [len(found) for found in (objects, again, longer)] == [6, 6, 4]
    assert listener.read == [wanted, wanted, wanted[4:] + fresh_keys(range(6, 8))]
    held = {key: obj.key for key, obj in zip(wanted, objects, strict=True)} | {
        obj.key: obj.key for obj in longer
    }
    for told in listener.read:
        assert all(key is held[key] for key in told)
    assert all(obj.key is key for obj, key in zip(objects, stored, strict=False))
    l1.finish_read(wanted, 2)
    l1.finish_read(fresh_keys(range(4, 8)))
