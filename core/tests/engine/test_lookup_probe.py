"""A lookup of 8 keys or more past L1's prefix asks the adapters about the first of them
alone first: where none holds it (a new prompt) the prefix ends there and no other key is
asked about; where one does, or one cannot answer at once, the whole lookup goes on as
before, each adapter that answered asked about the keys after that one only, and every
pin the first question took is held by the request or given back.  An adapter that raised on
that question or answered it malformed is not asked again at once (one failure counted a
lookup); a key repeated right where L1's prefix ends is not asked about, and one L1 holds
not READY yet does not end the lookup there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from engine_support import (
    GatedConfig,
    gated_backend,
    keys_of,
    mock,
    parked_prefetch,
    payload,
    store,
    store_in_l2_only,
)

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers.prefetch import PROBE_MIN_KEYS
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.interface import LookupResult
from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 16 * 1024
COUNT = 2 * PROBE_MIN_KEYS


def asked(storage: StorageManager, index: int = 0) -> int:
    """Keys adapter ``index`` answered lookups about."""
    stats = storage.adapters[index].stats()
    return int(stats.get("lookup_hits", 0) + stats.get("lookup_misses", 0))


def assert_nothing_held(storage: StorageManager) -> None:
    # A key committed during the test may still be on its way to L2, read-locked by its
    # store until then.
    assert storage.flush(10)
    assert all(adapter.pinned_keys() == {} for adapter in storage.adapters)
    stats = storage.l1.stats()
    assert (stats.write_locked, stats.read_locks) == (0, 0)


def test_a_new_prompt_asks_the_adapters_about_its_first_key_alone(engine: Engine) -> None:
    storage = engine([mock(), mock(namespace="second")])
    handle, locked = storage.start_prefetch(keys_of(1, 40))
    assert locked == [] and storage.query_prefetch(handle) == 0
    assert asked(storage, 0) == asked(storage, 1) == 1
    prompt = keys_of(2, 40)
    store(storage, prompt[:5], SIZE)
    assert storage.flush(10)
    before = asked(storage)
    _, locked = storage.start_prefetch(prompt)
    assert locked == prompt[:5], "the L1 prefix; the first key past it asked about alone"
    assert asked(storage) - before == 1
    storage.release(locked)
    assert_nothing_held(storage)


def lookups(storage: StorageManager, index: int = 0) -> int:
    """Lookups asked of adapter ``index``, as /metrics counts them."""
    return int(storage.status()["adapters"][index]["lookups"])


def test_a_prompt_whose_first_key_past_l1_is_in_l2_is_looked_up_whole(engine: Engine) -> None:
    storage = engine([mock()])
    prompt = keys_of(3, 40)
    store_in_l2_only(storage, prompt[:30], SIZE)
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 30
    assert asked(storage) == 40, "each key asked about once: the first, then the others"
    assert lookups(storage) == 1
    objects = storage.read(prompt)
    assert [bytes(storage.view(obj)) for obj in objects] == [payload(key, SIZE) for key in prompt[:30]]
    storage.release(prompt[:30], 2)  # the read above and the prefetch's own lock
    assert_nothing_held(storage)


def test_an_adapter_that_cannot_answer_at_once_is_asked_about_every_key(engine: Engine) -> None:
    # A simulated latency makes the mock answer on its worker thread only.
    storage = engine([mock(), mock(latency_s=0.001, namespace="slow")])
    prompt = keys_of(4, 40)
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 0
    assert asked(storage, 1) == 40
    assert asked(storage, 0) == 40, "the first answered the first question: then asked about the others"
    assert_nothing_held(storage)


def test_a_short_remainder_is_asked_about_whole(engine: Engine) -> None:
    storage = engine([mock()])
    _, locked = storage.start_prefetch(keys_of(5, PROBE_MIN_KEYS - 1))
    assert locked == [] and asked(storage) == PROBE_MIN_KEYS - 1


def test_a_repeat_where_l1_s_prefix_ends_keeps_that_prefix(engine: Engine) -> None:
    storage = engine([mock()])
    prompt = keys_of(6, 4)
    store(storage, prompt, SIZE)
    assert storage.flush(10)  # in L2 too: the first question past the prefix is a hit
    _, locked = storage.start_prefetch(prompt + prompt * 3)
    assert locked == prompt
    storage.release(locked)
    assert_nothing_held(storage)


def failures(storage: StorageManager, reason: str) -> int:
    return int(storage.status()["failures"].get(reason, 0))


@pytest.mark.parametrize("stored", [0, 3], ids=["new-prompt", "first-keys-in-l2"])
def test_an_adapter_raising_at_once_counts_one_failure_a_lookup(engine: Engine, stored: int) -> None:
    storage = engine([mock()])
    prompt = keys_of(41, COUNT)
    store(storage, prompt[:stored], SIZE)
    assert storage.flush(10)
    storage.clear()
    calls: list[int] = []

    def raising(keys: object) -> LookupResult | None:
        calls.append(1)
        raise RuntimeError("lookup_and_lock_now broke")

    storage.adapters[0].lookup_and_lock_now = raising  # type: ignore[method-assign]
    assert storage.wait_prefetch(storage.submit_prefetch(prompt), 10) == stored
    assert len(calls) == 1, "asked once at once; the controller's submitted lookup answers"
    assert failures(storage, "l2_lookup_now_error") == 1
    storage.release(prompt[:stored])
    assert_nothing_held(storage)


@pytest.mark.parametrize("stored", [0, 3], ids=["new-prompt", "first-keys-in-l2"])
def test_a_malformed_first_answer_counts_one_failure_a_lookup(engine: Engine, stored: int) -> None:
    storage = engine([mock()])
    prompt = keys_of(42, COUNT)
    store(storage, prompt[:stored], SIZE)
    assert storage.flush(10)
    storage.clear()
    l2 = storage.adapters[0]
    look_up_now = l2.lookup_and_lock_now
    calls: list[int] = []

    def malformed(keys: list[object]) -> LookupResult | None:
        calls.append(len(keys))
        result = look_up_now(keys)  # type: ignore[arg-type]
        assert result is not None
        return LookupResult([*result.found, False], [*result.sizes, 0])  # one flag too many

    l2.lookup_and_lock_now = malformed  # type: ignore[method-assign]
    # A malformed answer is a miss for the whole lookup, as it was before the first question.
    assert storage.wait_prefetch(storage.submit_prefetch(prompt), 10) == 0
    assert calls == [1], "the adapter is not asked again about the whole lookup"
    assert failures(storage, "l2_lookup_bad_result") == 1
    assert_nothing_held(storage)


def test_a_repeat_right_past_l1_s_prefix_asks_no_adapter(engine: Engine) -> None:
    storage = engine([mock()])
    prompt = keys_of(43, 4)
    store(storage, prompt, SIZE)
    assert storage.flush(10)  # in L2 too: a question about the repeat would find it
    before = asked(storage)
    _, locked = storage.start_prefetch(prompt * PROBE_MIN_KEYS)
    assert locked == prompt
    assert asked(storage) == before, "the prefix ends at the repeat: nothing is left for L2"
    storage.release(locked)
    assert_nothing_held(storage)


def commit_written(storage: StorageManager, reserved: dict[ObjectKey, Any], keys: list[ObjectKey]) -> None:
    """Fill the L1 objects ``reserved`` for ``keys`` with their payloads and commit them."""
    for key in keys:
        storage.view(reserved[key])[:] = payload(key, SIZE)
    storage.commit_write(keys)


def load_after_the_parked(
    storage: StorageManager, parked: int, parked_keys: list[ObjectKey], handle: int, prompt: list[ObjectKey]
) -> None:
    """Open the ``gated`` adapter's gate: the parked prefetch (of ``parked_keys``) ends,
    then the one of ``handle`` loads every key of ``prompt``, each with its own bytes;
    both prefetches' locks and the read's are given back."""
    gated_backend(storage).gate.set()
    assert storage.wait_prefetch(parked, 10) == 1
    storage.release(parked_keys)
    assert storage.wait_prefetch(handle, 10) == len(prompt)
    objects = storage.read(prompt)
    assert [bytes(storage.view(obj)) for obj in objects] == [payload(key, SIZE) for key in prompt]
    storage.release(prompt, 2)


def test_a_key_being_written_in_l1_right_past_its_prefix_does_not_end_the_lookup(engine: Engine) -> None:
    # Its writer may commit it before the request starts, extending the L1 prefix (as it
    # does for any request queued): the keys after it in L2 are then loaded as before.
    storage = engine([AdapterSpec(type="gated_now", config=GatedConfig())], l2_prefetch_max_in_flight=1)
    prompt = keys_of(45, COUNT)
    store(storage, prompt[1:], SIZE)
    parked = parked_prefetch(storage, keys_of(44, 1), SIZE)  # holds the one slot
    writing = storage.reserve_write(prompt[:1], [SIZE])  # in L1, not READY, not in L2
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None, "queued behind the parked prefetch, not settled at the key being written"
    commit_written(storage, writing, prompt[:1])
    load_after_the_parked(storage, parked, keys_of(44, 1), handle, prompt)
    assert_nothing_held(storage)


def test_each_of_two_adapters_is_asked_about_each_key_once(engine: Engine) -> None:
    # The first misses the first key past L1 and holds the keys after it; the second
    # holds that key (the first question stops there): both answer about the rest.
    storage = engine([mock(), mock(namespace="second")])
    prompt = keys_of(46, COUNT)
    store_in_l2_only(storage, prompt, SIZE)
    first, second = storage.adapters
    assert first.delete(prompt[:1]) == [True]
    assert second.delete(prompt[1:]) == [True] * (COUNT - 1)
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == COUNT
    assert asked(storage, 0) == asked(storage, 1) == COUNT
    assert lookups(storage, 0) == lookups(storage, 1) == 1
    objects = storage.read(prompt)
    assert [bytes(storage.view(obj)) for obj in objects] == [payload(key, SIZE) for key in prompt]
    storage.release(prompt, 2)
    assert_nothing_held(storage)


@pytest.mark.parametrize("answer", ["not-now", "malformed"])
def test_a_hit_whose_rest_is_not_answered_at_once_gives_its_pin_back(engine: Engine, answer: str) -> None:
    # Found at the first question, then not answered at once about the keys after it:
    # the controller asks about every key (the pin of the first given back), or a
    # malformed answer makes the lookup a miss of every key, counted.
    storage = engine([mock()])
    prompt = keys_of(47, COUNT)
    store_in_l2_only(storage, prompt[:3], SIZE)
    l2 = storage.adapters[0]
    look_up_now = l2.lookup_and_lock_now
    calls: list[int] = []

    def second_call_fails(keys: list[object]) -> LookupResult | None:
        calls.append(len(keys))
        result = look_up_now(keys)  # type: ignore[arg-type]
        if len(calls) == 1 or result is None:
            return result
        if answer == "not-now":
            l2.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])  # type: ignore[misc]
            return None
        return LookupResult([*result.found, False], [*result.sizes, 0])  # one flag too many

    assert look_up_now(prompt[:1]) == ([True], [SIZE])  # another reader's pin: it stays
    l2.lookup_and_lock_now = second_call_fails  # type: ignore[method-assign]
    expected = 3 if answer == "not-now" else 0
    assert storage.wait_prefetch(storage.submit_prefetch(prompt), 10) == expected
    assert calls == [1, COUNT - 1]
    assert failures(storage, "l2_lookup_bad_result") == (answer == "malformed")
    storage.release(prompt[:expected])
    assert l2.pinned_keys() == {prompt[0]: 1}, "given back once"
    l2.unlock(prompt[:1])
    assert_nothing_held(storage)


def test_a_lookup_that_fails_past_the_first_question_gives_its_pin_back(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = engine([mock()])
    prompt = keys_of(48, COUNT)
    store_in_l2_only(storage, prompt, SIZE)

    def broken(keys: object) -> list[object]:
        raise RuntimeError("deduplication broke")

    l2 = storage.adapters[0]
    assert l2.lookup_and_lock_now(prompt[:1]) == ([True], [SIZE])  # another reader's pin: it stays
    monkeypatch.setattr("lmcache_tiers.controllers.prefetch.unique_prefix", broken)
    with pytest.raises(RuntimeError, match="deduplication broke"):
        storage.start_prefetch(prompt)
    assert l2.pinned_keys() == {prompt[0]: 1}, "the first question's pin, given back once"
    l2.unlock(prompt[:1])


class Interrupted(BaseException):
    """An interrupt raised through an adapter's call (not an ``Exception``)."""


@pytest.mark.parametrize("where", ["rest-interrupted", "second-adapter-interrupted", "queue-broke"])
def test_a_lookup_that_fails_once_answered_gives_back_the_pins_of_its_answers(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # The first adapter holds the first key past L1: its answer (that key's pin from the
    # first question, the others' from the question about the rest) is the request's,
    # or that key's pin is still the first question's when the question about the rest
    # is interrupted; the lookup then fails before it is queued.  Another reader's pin
    # of that key stays.
    storage = engine([mock(), mock(namespace="second")])
    prompt = keys_of(49, COUNT)
    store_in_l2_only(storage, prompt, SIZE)
    first, second = storage.adapters
    assert first.lookup_and_lock_now(prompt[:1]) == ([True], [SIZE])

    look_up_now = first.lookup_and_lock_now

    def first_question_only(keys: list[object]) -> LookupResult | None:
        if len(keys) > 1:
            raise Interrupted  # asked about the keys after the first
        return look_up_now(keys)  # type: ignore[arg-type]

    def broken(*args: object) -> None:
        raise Interrupted if where == "second-adapter-interrupted" else RuntimeError("queue broke")

    if where == "rest-interrupted":
        monkeypatch.setattr(first, "lookup_and_lock_now", first_question_only)
    elif where == "second-adapter-interrupted":
        monkeypatch.setattr(second, "lookup_and_lock_now", broken)
    else:
        monkeypatch.setattr(storage.prefetch._handles, "enqueue", broken)
    with pytest.raises((Interrupted, RuntimeError)):
        storage.start_prefetch(prompt)
    assert first.pinned_keys() == {prompt[0]: 1}, "the other reader's pin, and no other"
    assert second.pinned_keys() == {}
    first.unlock(prompt[:1])


def test_a_queued_lookup_whose_first_keys_became_ready_in_l1_drops_their_pins_once(engine: Engine) -> None:
    # The first question's hit and the answer about the keys after it are one answer of
    # the request: when its first keys are written to L1 while it is queued, that answer
    # shrinks to the keys still left, each pin dropped once, the others loaded.
    storage = engine([AdapterSpec(type="gated_now", config=GatedConfig())], l2_prefetch_max_in_flight=1)
    prompt = keys_of(50, COUNT)
    store_in_l2_only(storage, prompt, SIZE)
    parked = parked_prefetch(storage, keys_of(51, 1), SIZE)  # holds the one slot
    l2 = storage.adapters[0]
    assert l2.lookup_and_lock_now(prompt[:1]) == ([True], [SIZE])  # another reader's pin: it stays
    handle, locked = storage.start_prefetch(prompt)
    assert locked is None, "queued behind the parked prefetch"
    assert asked(storage) == 1 + 1 + COUNT, "the parked key, the other reader's, then each key once"
    commit_written(storage, storage.reserve_write(prompt[:3], [SIZE] * 3), prompt[:3])
    load_after_the_parked(storage, parked, keys_of(51, 1), handle, prompt)
    assert storage.flush(10)
    assert l2.pinned_keys() == {prompt[0]: 1}, "its pin on the first key dropped once"
    l2.unlock(prompt[:1])
    assert_nothing_held(storage)
