"""The L2 conformance suite itself: each test must fail for a backend broken the way it
checks, and pass for a sound one -- a suite test that cannot fail proves nothing.

Each broken backend below is the dict backend the core tests use with one defect; the
suite test named next to it runs against it outside pytest's collection (with the
suite's own fixture code) and must raise ``AssertionError``.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Sequence

import pytest
from l2_backends import DictBackend, DictConfig

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendContext, Capacity, L2Adapter, create_adapter
from lmcache_tiers.l2.context import buffer_address
from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, PERSISTENCE, BufferPool, L2AdapterSuite, make_keys
from lmcache_tiers.testing.l2_support import page_aligned_buffer

#: the capacity every backend here declares: the suite's capacity tests fill it with 16 objects
CAPACITY_BYTES = 256 << 10


class _SuiteOn(L2AdapterSuite):
    """The suite on one backend class, built directly (not through the plugin registry)."""

    component_name = "test_dict"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    def __init__(self, backend: type[DictBackend]) -> None:
        self.backend = backend

    def make_config(self) -> DictConfig:
        return DictConfig(namespace=uuid.uuid4().hex, capacity=CAPACITY_BYTES)

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        return create_adapter(self.backend, config, self.make_context(config, l1_buffer))


def run_suite_test(backend: type[DictBackend], name: str) -> None:
    """Run the suite test ``name`` against ``backend``; its assertion errors propagate."""
    suite = _SuiteOn(backend)
    l1_buffer = page_aligned_buffer(suite.l1_buffer_size)
    opened: list[L2Adapter] = [suite.open_adapter(suite.make_config(), l1_buffer)]
    fixtures = {
        "adapter": opened[0],
        "pool": BufferPool(l1_buffer),
        "reopen_adapter": lambda previous: suite.reopen(previous, l1_buffer, opened),
    }
    test = getattr(suite, name)
    try:
        test(**{parameter: fixtures[parameter] for parameter in inspect.signature(test).parameters})
    finally:
        for adapter in opened:
            adapter.close()


# -- backends with one defect each --------------------------------------------------------------


class WrongBytesOnLoad(DictBackend):
    """Loads report success with the first byte of every object flipped."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = super().get_many_into(keys, buffers)
        for loaded, buffer in zip(ok, buffers, strict=True):
            if loaded:
                buffer[0] ^= 0xFF
        return ok


class DropsWrites(DictBackend):
    """Stores report success and keep nothing."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return [True] * len(keys)


class DeleteKeepsObjects(DictBackend):
    """Deletes report what was there and remove nothing."""

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self.lock:
            return [key in self.objects for key in keys]


class DeclaresNoCapacity(DictBackend):
    """Accepts whatever is stored: no capacity reaches core."""

    def capacity(self) -> None:
        return None


class KeepsTheCallersBuffer(DictBackend):
    """Keeps a view of the caller's buffer instead of copying it (zero-copy gone wrong):
    whatever the caller writes there after the store completes is what a load returns."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            self.objects.update(zip(keys, payloads, strict=True))  # type: ignore[arg-type]
        return [True] * len(keys)


def _collapsed(key: ObjectKey) -> ObjectKey:
    """The key with the fields a sloppy name encoding drops set to their defaults."""
    return ObjectKey("suite-model", 0, key.chunk_hash, 0, key.cache_salt)


class IgnoresModelRankAndGroup(DictBackend):
    """Names objects by chunk hash and salt only: keys of other models, ranks or groups
    overwrite each other."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return super().put_many([_collapsed(key) for key in keys], payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:  # type: ignore[override]
        return super().contains_many([_collapsed(key) for key in keys])  # type: ignore[return-value]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return super().get_many_into([_collapsed(key) for key in keys], buffers)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return super().delete_many([_collapsed(key) for key in keys])


class SmallerThanItsCapacity(DictBackend):
    """Holds 3/4 of the capacity it declares and makes room by dropping its oldest objects
    behind core's back, so stores core admitted silently push earlier ones out."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        ok = super().put_many(keys, payloads)
        with self.lock:
            while sum(map(len, self.objects.values())) > CAPACITY_BYTES * 3 // 4:
                del self.objects[next(iter(self.objects))]
        return ok


class StaleReadCache(DictBackend):
    """Serves repeated loads of a key from a cache that stores do not invalidate."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.cache: dict[ObjectKey, bytes] = {}

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = super().get_many_into(keys, buffers)
        for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
            cached = self.cache.get(key)
            if ok[index] and cached is not None and len(cached) == buffer.nbytes:
                buffer[:] = cached
            elif ok[index]:
                self.cache[key] = bytes(buffer)
        return ok


class SkipsRepeatedLoads(DictBackend):
    """Reports a key it loaded before as loaded without copying it again."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.loaded: set[ObjectKey] = set()

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        fresh = [index for index, key in enumerate(keys) if key not in self.loaded]
        copied = super().get_many_into([keys[i] for i in fresh], [buffers[i] for i in fresh])
        ok = [key in self.loaded for key in keys]
        for index, done in zip(fresh, copied, strict=True):
            ok[index] = done
            if done:
                self.loaded.add(keys[index])
        return ok


class LoadsDeletedObjects(DictBackend):
    """Deletes hide objects from lookups and listings, but loads still find them."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.trash: dict[ObjectKey, bytes] = {}

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self.lock:
            for key in keys:
                if key in self.objects:
                    self.trash[key] = self.objects[key]
        return super().delete_many(keys)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = super().get_many_into(keys, buffers)
        for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
            kept = self.trash.get(key)
            if not ok[index] and kept is not None and len(kept) == buffer.nbytes:
                buffer[:] = kept
                ok[index] = True
        return ok


class WritesPastTheLoadBuffer(DictBackend):
    """Every load writes one byte more than the buffer holds, through the L1 arena the
    buffer is a slice of -- as a native backend does through the arena's registered base
    address when it rounds a transfer up -- onto the next object's first byte in the server."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = super().get_many_into(keys, buffers)
        arena = self.context.l1_buffer
        assert arena is not None, "the suite hands every adapter its L1 buffer"
        for buffer in buffers:
            offset = self.context.l1_offset(buffer)
            assert offset is not None, "the suite loads into slices of the L1 buffer"
            arena[offset + buffer.nbytes] ^= 0xFF
        return ok


class TransformsTheStoreBufferInPlace(DictBackend):
    """Stores what it was given, then leaves the caller's buffer changed (an encoding done
    in place): the L1 object the buffer is goes on being served with wrong bytes."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        ok = super().put_many(keys, payloads)
        for payload in payloads:
            if payload.nbytes:
                payload[0] ^= 0xFF
        return ok


class PadsTheStoreBufferToAPage(DictBackend):
    """Zero-pads each payload to a whole page in the caller's memory before writing it (as
    an O_DIRECT write wants), through the L1 arena: the next object's first bytes are lost."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        arena = self.context.l1_buffer
        assert arena is not None, "the suite hands every adapter its L1 buffer"
        for payload in payloads:
            offset = self.context.l1_offset(payload)
            assert offset is not None, "the suite stores from slices of the L1 buffer"
            end = offset + payload.nbytes
            arena[end : -(-end // 4096) * 4096] = bytes(-end % 4096)
        return super().put_many(keys, payloads)


class CorruptsObjectsSmallerThanAPage(DictBackend):
    """Objects under a page take a path of their own that loses their last byte."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        ok = super().get_many_into(keys, buffers)
        for loaded, buffer in zip(ok, buffers, strict=True):
            if loaded and 0 < buffer.nbytes < 4096:
                buffer[-1] = 0
        return ok


#: namespace -> objects deleted from it whose entries the listing kept
_LISTED_AFTER_DELETE: dict[str, dict[ObjectKey, int]] = {}


class ListsDeletedObjects(DictBackend):
    """Deletes remove objects but not their entries in the index read at start (kept in
    memory meanwhile), so a reopened adapter lists what earlier runs deleted."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.index_read_at_start = dict(_LISTED_AFTER_DELETE.get(config.namespace, {}))

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        kept = _LISTED_AFTER_DELETE.setdefault(self.config.namespace, {})
        with self.lock:
            for key in keys:
                if key in self.objects:
                    kept[key] = len(self.objects[key])
        return super().delete_many(keys)

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        listed = dict(super().list_keys())
        return [*listed.items(), *self.index_read_at_start.items()]


#: namespace -> the first version stored of each key (what the index rebuilt at start reads)
_FIRST_VERSIONS: dict[str, dict[ObjectKey, bytes]] = {}


class RebuildsFromFirstVersions(DictBackend):
    """Appends every version to a log and, when opened, rebuilds its index from the first
    record of each key instead of the last: reopening brings overwritten bytes back."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        first = _FIRST_VERSIONS.setdefault(config.namespace, {})
        with self.lock:
            for key in self.objects:
                self.objects[key] = first.get(key, self.objects[key])

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        first = _FIRST_VERSIONS.setdefault(self.config.namespace, {})
        for key, payload in zip(keys, payloads, strict=True):
            first.setdefault(key, bytes(payload))
        return super().put_many(keys, payloads)


class KeepsSixteenKeysOfABatch(DictBackend):
    """Writes batches in pipelines of 16 keys and sends only the first: every key past the
    16th of a store reports success and is lost."""

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        super().put_many(keys[:16], payloads[:16])
        return [True] * len(keys)


class ForgetsOnClose(DictBackend):
    """Keeps objects only as long as one adapter is open."""

    def close(self) -> None:
        with self.lock:
            self.objects.clear()


# -- what the suite must catch -------------------------------------------------------------------

CAUGHT: list[tuple[type[DictBackend], str]] = [
    (WrongBytesOnLoad, "test_store_lookup_load_round_trip"),
    (DropsWrites, "test_store_lookup_load_round_trip"),
    (DeleteKeepsObjects, "test_delete_reports_per_key"),
    (DeclaresNoCapacity, "test_store_beyond_capacity_fails"),
    (ForgetsOnClose, "test_objects_survive_reopening"),
    (KeepsTheCallersBuffer, "test_store_copies_the_payload_before_completing"),
    (IgnoresModelRankAndGroup, "test_keys_differing_in_one_field_are_distinct_objects"),
    (IgnoresModelRankAndGroup, "test_every_key_field_survives_reopening"),
    (SmallerThanItsCapacity, "test_store_beyond_capacity_fails"),
    (StaleReadCache, "test_a_load_after_an_overwrite_returns_the_new_bytes"),
    (SkipsRepeatedLoads, "test_a_load_after_an_overwrite_returns_the_new_bytes"),
    (SkipsRepeatedLoads, "test_concurrent_submits_from_two_threads"),
    (LoadsDeletedObjects, "test_delete_reports_per_key"),
    (WritesPastTheLoadBuffer, "test_store_lookup_load_round_trip"),
    (WritesPastTheLoadBuffer, "test_lookup_of_absent_keys_misses"),
    (WritesPastTheLoadBuffer, "test_concurrent_submits_from_two_threads"),
    (TransformsTheStoreBufferInPlace, "test_store_lookup_load_round_trip"),
    (PadsTheStoreBufferToAPage, "test_store_lookup_load_round_trip"),
    (CorruptsObjectsSmallerThanAPage, "test_byte_accounting_total_and_by_salt"),
    (ListsDeletedObjects, "test_deletes_survive_reopening"),
    (RebuildsFromFirstVersions, "test_overwrites_survive_reopening"),
    (KeepsSixteenKeysOfABatch, "test_large_batches_round_trip"),
]


@pytest.mark.parametrize(
    ("backend", "name"), CAUGHT, ids=[f"{backend.__name__}-{name}" for backend, name in CAUGHT]
)
def test_the_suite_fails_a_broken_backend(backend: type[DictBackend], name: str) -> None:
    with pytest.raises(AssertionError):
        run_suite_test(backend, name)


def test_a_load_writing_past_its_buffer_is_named() -> None:
    with pytest.raises(AssertionError, match=r"load of ObjectKey\(.*\) wrote 1 bytes past its buffer"):
        run_suite_test(WritesPastTheLoadBuffer, "test_store_lookup_load_round_trip")


def test_guards_tell_how_far_a_load_wrote_before_or_past_its_buffer() -> None:
    arena = page_aligned_buffer(1 << 20)
    pool = BufferPool(arena)
    (key,) = make_keys(1)
    first, second = pool.take(1000), pool.take(5000)
    assert pool.guard_damage(key, first) is None and pool.guard_damage(key, second) is None
    start = buffer_address(second) - buffer_address(arena)
    assert buffer_address(second) % 4096 == 0, "buffers start on a page, guards or not"
    arena[start - 3] ^= 0xFF
    assert pool.guard_damage(key, second) == f"load of {key} wrote 3 bytes before its buffer"
    arena[start + 5000 + 99] ^= 0xFF
    assert pool.guard_damage(key, second) == f"load of {key} wrote 100 bytes past its buffer"
    assert pool.guard_damage(key, first) is None, "a neighbour's guards are its own"
    with pytest.raises(ValueError, match="not a buffer handed out by this pool"):
        pool.guard_damage(key, second[1:])


@pytest.mark.parametrize("name", sorted({name for _, name in CAUGHT}))
def test_the_same_suite_tests_pass_on_a_sound_backend(name: str) -> None:
    run_suite_test(DictBackend, name)


class ThirtyTwoSlots(DictBackend):
    """A sound slot store configured with 32 slots -- room for every other batch the suite
    stores -- whose declared capacity core holds the 40-key batch to."""

    def capacity(self) -> Capacity:
        return Capacity(objects=32)


def test_the_large_batch_fits_a_sound_backend_declaring_fewer_slots() -> None:
    # Core refuses keys past the declared capacity: a batch larger than the slots a
    # plugin's suite configured is the suite's demand, not the backend's defect.
    run_suite_test(ThirtyTwoSlots, "test_large_batches_round_trip")
