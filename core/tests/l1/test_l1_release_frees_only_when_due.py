"""A release that leaves no object to free goes nowhere near the freeing path.

Every RELEASE of an engine's prompt drops the locks of objects that stay in L1: building
the listeners' (empty) list of deleted keys for them was paid on every one.  A temporary
object unlocked by the release is still freed, and the listeners told, in the same call.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.objects import L1Object
from lmcache_tiers.l1.table import ObjectTable

ALIGN = 4096
KEYS = [ObjectKey("test-release-free", 0, index.to_bytes(8, "big")) for index in range(4)]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(8 * len(KEYS) * ALIGN, align=ALIGN, prefault=False)
    assert all(manager.finish_write(list(manager.reserve_write(KEYS, [ALIGN] * len(KEYS)))))
    yield manager
    manager.close()


@pytest.fixture
def frees(monkeypatch: pytest.MonkeyPatch) -> list[list[ObjectKey]]:
    """The keys of each call of the table's freeing path."""
    seen: list[list[ObjectKey]] = []
    free = ObjectTable.free

    def counted(self: ObjectTable, objs: list[L1Object], *args: object) -> None:
        seen.append([obj.key for obj in objs])
        free(self, objs, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ObjectTable, "free", counted)
    return seen


def test_releasing_objects_that_stay_frees_nothing(l1: L1Manager, frees: list[list[ObjectKey]]) -> None:
    assert len(l1.reserve_read_prefix(KEYS, 2)) == len(KEYS)
    l1.finish_read(KEYS)  # one lock left on each
    l1.finish_read(KEYS)  # the last ones: unlocked, but not temporary
    l1.finish_read(KEYS)  # nothing held any more
    assert frees == []
    assert l1.stats().read_locks == 0
    assert all(l1.contains(key) for key in KEYS)


def test_a_temporary_object_unlocked_by_a_release_is_freed_in_it(
    l1: L1Manager, frees: list[list[ObjectKey]]
) -> None:
    assert len(l1.reserve_read_prefix(KEYS)) == len(KEYS)
    l1.set_temporary(KEYS[1:2], True)
    l1.finish_read(KEYS)
    assert frees == [KEYS[1:2]]
    assert not l1.contains(KEYS[1])
    assert all(l1.contains(key) for key in KEYS if key != KEYS[1])
