"""A prefetch given up while its adapter's results are being handled (a failure handling
one load's result) gives back what it holds once: another load of the same request,
reaped in the same batch, is not handled after it as if the request still ran -- that
would drop its keys' adapter pins a second time (other holders' pins), count the request
failed twice and publish its result twice."""

from __future__ import annotations

from typing import Any

import pytest
from engine_support import GatedConfig, gated_backend, keys_of, payload, store, wait_for

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers.prefetch import PrefetchController
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.interface import L2Adapter

SIZE = 16 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def test_a_load_reaped_with_one_whose_handling_failed_is_not_handled_again(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = engine([gated(), gated()])
    first, second = storage.adapters
    keys = keys_of(61, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    # The first adapter holds the first two keys only, and fails to load the second: the
    # second adapter loads the last two (planned there) and, as a fallback, the second --
    # two loads of one request on one adapter.
    first_backend, second_backend = gated_backend(storage, 0), gated_backend(storage, 1)
    first_backend.delete_many(keys[2:])
    first_backend.fail_loads.add(keys[1])
    # Another holder's pins on the keys the second adapter loads: only the request's own
    # pins may go when it ends.
    # (Taken straight in its pin table: the controller pops every lookup result itself.)
    assert isinstance(second, BackendAdapter)
    assert all(second.state.pins.pin(keys[1:]))

    controller = storage.prefetch
    assert isinstance(controller, PrefetchController)
    # Both of the second adapter's loads report before the controller pops its results,
    # so that they are handled in one batch.
    board = second.state.board
    popping = controller._loads._pop_completed

    def pop_both(adapter: L2Adapter) -> Any:
        if adapter is second:
            assert wait_for(lambda: board.pending_count() == 0)
        return popping(adapter)

    monkeypatch.setattr(controller._loads, "_pop_completed", pop_both)
    # Handling the first of them fails (a bug, or an adapter's malformed result).
    handle_load = PrefetchController._load_done
    failed: list[Any] = []

    def failing_once(self: PrefetchController, slot: Any, load: Any, reported: Any) -> None:
        if slot.adapter is second and not failed:
            failed.append(load)
            raise RuntimeError("injected failure handling a load's result")
        handle_load(self, slot, load, reported)

    monkeypatch.setattr(PrefetchController, "_load_done", failing_once)

    second_backend.gate.clear()
    handle = storage.submit_prefetch(keys)
    assert second_backend.loads_started.acquire(timeout=10)
    assert second_backend.loads_started.acquire(timeout=10), "no fallback load on the second adapter"
    second_backend.gate.set()

    assert storage.wait_prefetch(handle, 10) == 0
    assert storage.flush(10)
    assert failed, "the injected failure never ran"
    assert storage.status()["failures"]["prefetch_internal_error"] == 1
    assert second.pinned_keys() == dict.fromkeys(keys[1:], 1), "another holder's pins were dropped"
    second.unlock(keys[1:])
    assert first.pinned_keys() == {} and second.pinned_keys() == {}
    assert storage.l1.stats().write_locked == 0
    # Nothing of the request is left: the same prefetch runs whole once the faults are gone.
    first_backend.fail_loads.clear()
    monkeypatch.undo()
    handle = storage.submit_prefetch(keys)
    assert storage.wait_prefetch(handle, 10) == 4
    for obj in storage.read(keys):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
    storage.release(keys, 2)
