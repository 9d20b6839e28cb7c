"""A store's layouts are checked once per distinct (layout, size) pair: a bad one anywhere
in the batch still refuses the whole reservation, naming the first bad pair."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_support import keys_of

from lmcache_tiers.storage import StorageManager

GOOD = "float16[2,1024]"  # 4096 bytes
SIZE = 4096


def test_a_bad_layout_behind_repeated_good_ones_refuses_the_batch(
    engine: Callable[..., StorageManager],
) -> None:
    storage = engine()
    keys = keys_of(1, 5)
    layouts = [GOOD, GOOD, "float16[3,1024]", GOOD, "float16[5,1024]"]
    with pytest.raises(ValueError, match=r"float16\[3,1024\] describes 6144 bytes"):
        storage.reserve_write(keys, [SIZE] * len(keys), layouts)
    assert len(storage.l1) == 0


def test_repeated_layouts_are_kept_with_each_object(engine: Callable[..., StorageManager]) -> None:
    storage = engine()
    keys = keys_of(2, 3)
    reserved = storage.reserve_write(keys, [SIZE, SIZE, 2 * SIZE], [GOOD, GOOD, "float16[2,2048]"])
    assert [obj.layout for obj in reserved.values()] == [GOOD, GOOD, "float16[2,2048]"]
    assert storage.commit_reserved(reserved) == keys
