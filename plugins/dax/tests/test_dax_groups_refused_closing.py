"""A store or load group the in-flight guard refuses -- the adapter closed after the
call's own closing check -- is counted like every other object a close stops
(``store_stopped_closing``, ``load_stopped_closing``), so each refused key is in /metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dax_helpers import backend_of, config, open_dax, shm_dir, store

from lmcache_tiers.testing.l2 import make_keys


def closing_after(step: Callable[..., Any], close: Callable[[], None]) -> Callable[..., Any]:
    """``step``, then the adapter's whole close: it lands after the call's closing check
    and before the group enters the in-flight guard."""

    def closed_after_step(*args: Any) -> Any:
        result = step(*args)
        close()
        return result

    return closed_after_step


def test_a_store_group_refused_by_the_in_flight_guard_is_counted_stopped_closing() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img", slots=4))
        backend = backend_of(adapter)
        keys = make_keys(3)
        # The check right after put_many's closing check: the close happens there.
        backend._stores_paused = closing_after(backend._stores_paused, adapter.close)  # type: ignore[method-assign]
        payloads = [memoryview(bytearray(b"refused" * 100)) for _ in keys]
        assert backend.put_many(keys, payloads) == [False, False, False]
        assert adapter.stats().get("store_stopped_closing", 0) == 3
        assert backend.table.used_slots == 0, "the claims were given back"


def test_a_load_group_refused_by_the_in_flight_guard_is_counted_stopped_closing() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img", slots=4))
        backend = backend_of(adapter)
        keys = make_keys(2)
        assert store(adapter, keys, [b"kept" * 100, b"also" * 100]) == [True, True]
        # The slots are taken for the load, then the close runs before the copies.
        backend.table.acquire = closing_after(backend.table.acquire, adapter.close)  # type: ignore[method-assign]
        buffers = [memoryview(bytearray(400)) for _ in keys]
        assert backend.get_many_into(keys, buffers) == [False, False]
        assert adapter.stats().get("load_stopped_closing", 0) == 2
