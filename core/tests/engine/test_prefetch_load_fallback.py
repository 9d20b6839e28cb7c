"""A key its first adapter fails to load is loaded from the next adapter whose lookup found
it: the hit prefix goes on, every byte handed out is the key's own, and every pin taken is
given back, on success, on a second failure and when the request is given up."""

from __future__ import annotations

from engine_support import GatedConfig, gated_backend, keys_of, mock, payload, spec, store
from lmcache_plugin_fault_inject.backend import rate_chooses

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def in_every_adapter(storage: StorageManager, keys: list[ObjectKey]) -> None:
    """``keys`` stored in every adapter, and in L1 no more."""
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    for adapter in storage.adapters:
        assert adapter.pinned_keys() == {}


def prefetch_and_check(storage: StorageManager, keys: list[ObjectKey]) -> int:
    """Prefetch ``keys``, check every byte of the prefix found, release it; its length."""
    hits = storage.wait_prefetch(storage.submit_prefetch(keys), 10)
    assert hits is not None
    for obj in storage.read(keys[:hits]):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE), "handed out bytes not the key's"
    storage.release(keys[:hits], 2)
    return hits


def settled(storage: StorageManager) -> None:
    """Nothing pinned in any adapter, nothing reserved in L1."""
    assert storage.flush(10)
    for adapter in storage.adapters:
        assert adapter.pinned_keys() == {}, adapter
    assert storage.l1.stats().write_locked == 0


def test_a_key_the_first_adapter_fails_to_load_is_loaded_from_the_next(engine) -> None:
    storage = engine([gated(), mock(namespace="fallback-next")])
    keys = keys_of(1, 4)
    in_every_adapter(storage, keys)
    first = gated_backend(storage, 0)
    first.fail_loads.add(keys[1])  # scribbles into the buffer, then reports the key failed

    assert prefetch_and_check(storage, keys) == 4, "the prefix ended at a key the next adapter holds"
    status = storage.status()
    assert status["failures"]["l2_load_failed"] == 1
    assert status["failures"]["l2_load_fallback"] == 1
    assert status["adapters"][0]["keys_load_failed"] == 1
    assert status["adapters"][0]["keys_loaded"] == 3
    assert status["adapters"][1]["keys_loaded"] == 1
    settled(storage)


def test_every_key_of_an_adapter_whose_loads_all_fail_loads_from_the_next(engine) -> None:
    """The project's fault injector failing every load of the first adapter, as a backend
    gone down between lookup and load does."""
    failing = spec(
        {
            "type": "fault_inject",
            "inner": {"type": "mock", "namespace": "fallback-all-first"},
            "seed": 3,
            "load_fail_rate": 1.0,
        }
    )
    storage = engine([failing, mock(namespace="fallback-all-second")])
    keys = keys_of(2, 6)
    in_every_adapter(storage, keys)

    assert prefetch_and_check(storage, keys) == 6
    failures = storage.status()["failures"]
    assert failures["l2_load_failed"] == 6
    assert failures["l2_load_fallback"] == 6
    settled(storage)


def rate_only(seed: int, rate: float, namespace: str) -> AdapterSpec:
    """fault_inject with LMCache's ``rate`` alone: the keys a hash of key and seed picks
    fail every load, and nothing else fails."""
    raw = {
        "type": "fault_inject",
        "inner": {"type": "mock", "namespace": namespace},
        "seed": seed,
        "rate": rate,
    }
    return spec(raw)


def test_keys_the_rate_chose_end_the_prefix_at_every_prefetch(engine) -> None:
    storage = engine([rate_only(2, 0.3, "rate-alone")])
    keys = keys_of(5, 16)
    chosen = [rate_chooses(2, 0.3, key) for key in keys]
    assert any(chosen[1:]) and not chosen[0], "a hole past the first key (seed picked for it)"
    in_every_adapter(storage, keys)

    hole = chosen.index(True)
    assert prefetch_and_check(storage, keys) == hole
    failed = storage.adapters[0].stats()["injected_rate_failures"]
    assert failed > 0
    storage.clear()
    assert prefetch_and_check(storage, keys) == hole, "the same key fails every load"
    assert storage.adapters[0].stats()["injected_rate_failures"] == 2 * failed
    settled(storage)


def test_keys_the_rate_chose_load_from_the_next_adapter(engine) -> None:
    storage = engine([rate_only(2, 0.3, "rate-first"), mock(namespace="rate-second")])
    keys = keys_of(6, 16)
    chosen = [rate_chooses(2, 0.3, key) for key in keys]
    in_every_adapter(storage, keys)

    assert prefetch_and_check(storage, keys) == 16
    status = storage.status()
    assert status["failures"]["l2_load_fallback"] == sum(chosen) > 0
    assert storage.adapters[0].stats()["injected_rate_failures"] == sum(chosen)
    settled(storage)


def test_a_key_every_adapter_fails_to_load_ends_the_prefix(engine) -> None:
    storage = engine([gated(), gated(), gated()])
    keys = keys_of(3, 3)
    in_every_adapter(storage, keys)
    for index in range(3):
        gated_backend(storage, index).fail_loads.add(keys[1])

    assert prefetch_and_check(storage, keys) == 1, "wrong bytes or a key no adapter loaded were handed out"
    failures = storage.status()["failures"]
    assert failures["l2_load_failed"] == 3, "each adapter tried once"
    assert failures["l2_load_fallback"] == 2
    assert not storage.l1.contains(keys[1])
    settled(storage)


def test_a_copy_of_another_size_is_not_loaded_in_place_of_a_failed_one(engine) -> None:
    """The failed key's L1 object was reserved at its first adapter's size: a record of
    another size (another format or layout) cannot fill it whole."""
    storage = engine([gated(), gated()])
    keys = keys_of(4, 2)
    in_every_adapter(storage, keys)
    gated_backend(storage, 0).fail_loads.add(keys[0])
    second = gated_backend(storage, 1)
    second._data[keys[0]] = bytes(SIZE // 2)

    assert prefetch_and_check(storage, keys) == 0
    assert "l2_load_fallback" not in storage.status()["failures"]
    assert storage.status()["adapters"][1]["load_tasks_submitted"] == 0
    settled(storage)


def test_a_request_given_up_during_a_fallback_load_drops_every_pin(engine) -> None:
    """The key loads from its second adapter, which hangs; the third, its other spare,
    keeps its pin until the request is given up at its deadline, and loses it then."""
    # Results are kept half the lock TTL: the prefetch is given up 4 s after it starts,
    # time enough for the failed load to report and the fallback to start on a busy machine.
    storage = engine([gated(), gated(), gated()], l1_lock_ttl_s=8.0)
    keys = keys_of(5, 2)
    in_every_adapter(storage, keys)
    gated_backend(storage, 0).fail_loads.add(keys[0])
    second = gated_backend(storage, 1)
    second.gate.clear()

    handle = storage.submit_prefetch(keys)
    assert second.loads_started.acquire(timeout=10), "the failed key was not loaded from the next adapter"
    assert storage.adapters[2].pinned_keys() == {keys[0]: 1}, "the last spare is held for the key"
    assert storage.wait_prefetch(handle, 10) == 0, "given up at its result deadline"
    assert storage.status()["failures"]["prefetch_timed_out"] == 1
    assert storage.adapters[2].pinned_keys() == {}, "a spare's pin outlived its request"
    second.gate.set()
    settled(storage)
    assert not any(storage.l1.contains(key) for key in keys)


def test_keys_an_adapter_refuses_to_take_a_load_of_are_loaded_from_the_next(engine, monkeypatch) -> None:
    storage = engine([gated(), gated()])
    keys = keys_of(6, 3)
    in_every_adapter(storage, keys)

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the adapter is down")

    monkeypatch.setattr(storage.adapters[0], "submit_load", refuse)

    assert prefetch_and_check(storage, keys) == 3
    failures = storage.status()["failures"]
    assert failures["l2_load_submit_error"] == 1
    assert failures["l2_load_fallback"] == 3
    assert storage.status()["adapters"][1]["keys_loaded"] == 3
    settled(storage)


def test_a_key_a_client_wrote_meanwhile_does_not_cost_the_others_their_fallback(engine) -> None:
    """Both keys fail on the first adapter; while that load runs, a client writes the second
    one, taking its reservation from the load.  The first key still loads from the next
    adapter: the second, no longer the request's to fill, is not tried, and is no load the
    next adapter was refused."""
    storage = engine([gated(), gated()])
    keys = keys_of(7, 2)
    in_every_adapter(storage, keys)
    first = gated_backend(storage, 0)
    first.fail_loads.update(keys)
    first.gate.clear()

    handle = storage.submit_prefetch(keys)
    assert first.loads_started.acquire(timeout=10)
    assert store(storage, keys[1:], SIZE) == keys[1:], "the client's write took the load's reservation"
    first.gate.set()
    hits = storage.wait_prefetch(handle, 10)
    assert hits == 1, "the key the next adapter holds was not loaded from it"
    for obj in storage.read(keys[:1]):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
    storage.release(keys[:1], 2)
    failures = storage.status()["failures"]
    assert "l2_load_submit_error" not in failures, "L1's reservation gone, counted as the adapter's refusal"
    assert failures["l2_load_fallback"] == 1
    assert failures["l2_load_failed"] == 2
    settled(storage)
