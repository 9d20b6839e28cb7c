"""``reserve_read_prefix(generations=...)``: one generation per object it returns, at its
position, as the arena's table held it when the locks were taken -- whichever way the
prefix was found (probed, the last lookup's objects again, a repeated key)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096


def key(index: int) -> ObjectKey:
    return ObjectKey("prefix-generations", 0, index.to_bytes(8, "big"))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(32 * ALIGN, align=ALIGN, prefault=False)
    yield manager
    manager.close()


def store(l1: L1Manager, indices: list[int]) -> None:
    wanted = [key(index) for index in indices]
    l1.reserve_write(wanted, [ALIGN] * len(wanted))
    assert l1.finish_write(wanted) == [True] * len(wanted)


def moved_generations(l1: L1Manager) -> None:
    """Give every extent of the arena back at least once with distinct counts, so that
    no two extents share a generation and a value at the wrong position shows."""
    for rounds in range(1, 5):
        store(l1, list(range(100, 100 + rounds)))
        assert all(l1.delete([key(index) for index in range(100, 100 + rounds)]))


def test_generations_follow_the_prefix_position_by_position(l1: L1Manager) -> None:
    moved_generations(l1)
    store(l1, [1, 2, 3])
    asked = [key(1), key(2), key(3), key(9)]
    first: list[int] = []
    objects = l1.reserve_read_prefix(asked, generations=first)
    assert len(objects) == 3
    assert first == l1.generations(objects)
    assert len(set(first)) > 1  # the positions are told apart
    # the same keys again (the objects the last lookup found, without a probe)
    again: list[int] = []
    assert l1.reserve_read_prefix(asked[:3], generations=again) == objects
    assert l1.reserve_read_prefix(asked[:3], generations=again) == objects
    assert again == first * 2  # extended, never replaced
    # a repeated key: listed, and given its generation, at each of its positions
    repeated: list[int] = []
    objects = l1.reserve_read_prefix([key(2), key(1), key(2)], generations=repeated)
    assert repeated == l1.generations(objects) == [first[1], first[0], first[1]]
    cut: list[int] = []
    assert len(l1.reserve_read_prefix([key(2), key(1), key(2)], until_repeat=True, generations=cut)) == 2
    assert cut == [first[1], first[0]]
    missed: list[int] = []
    assert l1.reserve_read_prefix([key(9), key(1)], generations=missed) == []
    assert missed == []


def test_the_table_moves_after_the_lock_is_let_go(l1: L1Manager) -> None:
    store(l1, [1])
    taken: list[int] = []
    (obj,) = l1.reserve_read_prefix([key(1)], generations=taken)
    # What other threads may do once the lock is let go: delete it by force, and release
    # the key (credited to the quarantined extent first), which gives the extent back.
    assert l1.delete([key(1)], force=True) == [True]
    l1.finish_read([key(1)])
    assert l1.generations([obj]) != taken  # the extent went back: the reader must see that
