"""What the L2 conformance suite is built from: keys, payloads, buffers, a listener, and
the base class holding the suite's fixtures and helpers (see :mod:`lmcache_tiers.testing.l2`)."""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.l2.context import buffer_address
from lmcache_tiers.protocols import Serde
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import SerdeContext, encode_chain
from lmcache_tiers.testing.base import ComponentSuite, capability
from lmcache_tiers.testing.blocking import BlockingAdapterClient

#: objects survive ``close()`` and are found, loadable and accounted after reopening
PERSISTENCE = capability("persistence")
#: ``usage()`` is a fraction of a finite capacity and a store that does not fit fails
CAPACITY = capability("capacity")
#: deleting objects frees capacity, so stores that failed for lack of room succeed again
EVICTION = capability("eviction")
#: ``lookup_and_lock_now`` answers a lookup of keys never stored (``contains_many_now``)
IMMEDIATE_MISSES = capability("immediate_misses")
#: ``lookup_and_lock_now`` answers hits too (the whole index is in memory)
IMMEDIATE_HITS = capability("immediate_hits")
#: the suite can make the store fail (``failing_storage``): calls then raise, never
#: answer "absent", so core keeps what was stored accounted and serves it once it is back
BACKEND_FAILURES = capability("backend_failures")
#: the suite can damage an object where the backend keeps it (``damage_stored``): its
#: load then fails or misses, never succeeds with other bytes, and the record is removed
DETECTS_DAMAGE = capability("detects_damage")

Reopen = Callable[[L2Adapter], L2Adapter]


def make_keys(count: int, *, start: int = 0, salt: str = "", model: str = "suite-model") -> list[ObjectKey]:
    """Distinct keys of one prompt in prefix order; the policy suites use these too."""
    return [ObjectKey(model, 0, index.to_bytes(8, "big"), 0, salt) for index in range(start, start + count)]


def keys_differing_in_one_field() -> list[ObjectKey]:
    """A key, then one key per field that differs from it in that field only.

    The model name holds a ``/`` (as Hugging Face names do), which names of files and
    objects must escape; the longer chunk hash starts with the first key's hash.
    """
    base = ObjectKey("suite-model", 0, b"\x01" * 8, 0, "")
    return [
        base,
        ObjectKey("suite-org/suite-model", 0, base.chunk_hash, 0, ""),
        ObjectKey("suite-model", 1, base.chunk_hash, 0, ""),
        ObjectKey("suite-model", 0, base.chunk_hash + b"\x00", 0, ""),
        ObjectKey("suite-model", 0, base.chunk_hash, 1, ""),
        ObjectKey("suite-model", 0, base.chunk_hash, 0, "tenant-a"),
    ]


def pattern(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes, different for every seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


#: bytes of the guard region on each side of every buffer a :class:`BufferPool` hands out:
#: a whole page, so a native read rounded up to a page (O_DIRECT) ends inside the guard,
#: and a multiple of the pool's alignment, so the buffers between guards stay aligned
GUARD_BYTES = 4096
#: what a guard holds: neither zeros (padding) nor a byte run a payload is likely to end in
GUARD_FILL = bytes([0xA5, 0x5A, 0xC3, 0x3C]) * (GUARD_BYTES // 4)
_GUARD_ARRAY = np.frombuffer(GUARD_FILL, dtype=np.uint8)


def changes(loaded: Sequence[bytes], stored: Sequence[bytes]) -> str:
    """What differs between the objects loads returned and those stored, object by object:
    a short load (the end of the buffer left as it was), other bytes from the start, or
    another size -- so a failed round trip says which of those the backend did."""
    told = []
    for position, (got, want) in enumerate(zip(loaded, stored, strict=True)):
        if got == want:
            continue
        if len(got) != len(want):
            told.append(f"object {position}: {len(got)} bytes loaded, {len(want)} stored")
            continue
        differ = np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))
        first, last = int(differ[0]), int(differ[-1])
        told.append(
            f"object {position}: bytes {first}..{last} of {len(want)} differ from what was stored"
            + (
                " (its end: a load that filled less than the buffer?)"
                if last == len(want) - 1 and first > 0
                else ""
            )
        )
    if len(told) > 3:
        told[3:] = [f"and {len(told) - 3} more objects"]
    return "; ".join(told) if told else "no object differs"


def listing_differs(
    listed: Iterable[ObjectKey], expected: Iterable[ObjectKey], stored: int, invalid: int = 0
) -> str:
    """How a listing after reopening differs from the keys it should name, of ``stored``
    keys stored before: keys missing (objects that did not outlive ``close()``, or names
    the listing cannot decode back to their keys) or keys it names that it should not
    (deleted ones, or another key's name); ``invalid``: the entries the start-up scan
    ignored (``scan_invalid_entries``)."""
    listed_set, expected_set = set(listed), set(expected)
    missing, extra = expected_set - listed_set, listed_set - expected_set
    told = [f"after reopening, the listing names {len(listed_set)} keys of the {stored} stored"]
    if missing:
        told.append(
            f"{len(missing)} missing (a backend declaring PERSISTENCE keeps objects across close()"
            " and lists them with their keys unchanged), e.g. " + repr(sorted(missing, key=repr)[0])
        )
    if extra:
        told.append(
            f"{len(extra)} it should not name (deleted, or not stored), e.g. "
            + repr(sorted(extra, key=repr)[0])
        )
    if invalid:
        told.append(
            f"the start-up scan ignored {invalid} listed entries as invalid (scan_invalid_entries):"
            " list_keys() yields (key, stored size) pairs"
        )
    return "; ".join(told)


def invalid_entries(adapter: L2Adapter) -> int:
    """The listed entries the adapter's start-up scan ignored as not (key, size) pairs."""
    return int(adapter.stats().get("scan_invalid_entries", 0))


def listing_note(adapter: L2Adapter) -> str:
    """What the start-up scan ignored, for a message about what it accounted."""
    invalid = invalid_entries(adapter)
    return f" (the scan ignored {invalid} listed entries as not (key, size) pairs)" if invalid else ""


def _changed(guard: memoryview) -> np.ndarray:
    """Indexes of the bytes of ``guard`` that no longer hold the guard fill."""
    return np.flatnonzero(np.frombuffer(guard, dtype=np.uint8) != _GUARD_ARRAY)


def page_aligned_buffer(size: int) -> memoryview:
    """Anonymous memory starting on a page, as the server's L1 arena does."""
    return memoryview(mmap.mmap(-1, size))


class BufferPool:
    """Bump allocator over the suite's L1 buffer: every test buffer is a slice of it.

    Each buffer sits between two guard regions of :data:`GUARD_FILL` in the same memory,
    as an extent of the server's L1 arena sits between its neighbours: an adapter that
    writes outside a load buffer (through registered memory, a mapping, O_DIRECT) changes
    a guard instead of another object's bytes, and :meth:`guard_damage` tells.
    """

    #: buffers start on a page, as the server's L1 extents do, so adapters that move aligned
    #: buffers in place (O_DIRECT) take that path here too rather than a bounce buffer
    alignment = 4096

    def __init__(self, arena: memoryview) -> None:
        self.arena = arena
        self.offset = 0
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}  # offset in the arena -> size, of every buffer handed out

    def take(self, size: int) -> memoryview:
        with self._lock:
            guard_start = -(-self.offset // self.alignment) * self.alignment
            start = guard_start + GUARD_BYTES
            end = start + size
            if end + GUARD_BYTES > self.arena.nbytes:
                raise MemoryError(
                    f"suite L1 buffer exhausted ({self.arena.nbytes} bytes); raise l1_buffer_size"
                )
            self.offset = end + GUARD_BYTES
            self.arena[guard_start:start] = GUARD_FILL
            self.arena[end : end + GUARD_BYTES] = GUARD_FILL
            self._sizes[start] = size
            return self.arena[start:end]

    def filled(self, data: bytes) -> memoryview:
        view = self.take(len(data))
        view[:] = data
        return view

    def _start_of(self, buffer: memoryview) -> int:
        start = buffer_address(buffer) - buffer_address(self.arena) if buffer.nbytes else -1
        if self._sizes.get(start) != buffer.nbytes:
            raise ValueError("not a buffer handed out by this pool (guards are around whole buffers only)")
        return start

    def guard_damage(self, key: ObjectKey, buffer: memoryview, action: str = "load") -> str | None:
        """What a load (or ``action``) of ``key`` into ``buffer`` wrote outside it, or None."""
        if buffer.nbytes == 0:
            return None
        start = self._start_of(buffer)
        end = start + buffer.nbytes
        before = self.arena[start - GUARD_BYTES : start]
        after = self.arena[end : end + GUARD_BYTES]
        if before.tobytes() == GUARD_FILL and after.tobytes() == GUARD_FILL:  # the common case
            return None
        past, ahead = _changed(after), _changed(before)
        if past.size:
            return f"{action} of {key} wrote {int(past[-1]) + 1} bytes past its buffer"
        return f"{action} of {key} wrote {GUARD_BYTES - int(ahead[0])} bytes before its buffer"

    def guard_damages(
        self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview], action: str = "load"
    ) -> list[str]:
        """What a load of ``keys`` into ``buffers`` wrote outside them, one line per buffer."""
        damage = (self.guard_damage(key, buffer, action) for key, buffer in zip(keys, buffers, strict=True))
        return [message for message in damage if message is not None]

    def assert_guards_intact(
        self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview], action: str = "load"
    ) -> None:
        """Fail if a load of ``keys`` into ``buffers`` (hit, miss or failure) wrote outside them."""
        damages = self.guard_damages(keys, buffers, action)
        assert not damages, "; ".join(damages)


class RecordingListener:
    """Collects every notification, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, L2Adapter, list[ObjectKey]]] = []
        self._lock = threading.Lock()

    def _add(self, kind: str, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.events.append((kind, adapter, list(keys)))

    def on_l2_keys_stored(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("stored", adapter, keys)

    def on_l2_keys_loaded(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("loaded", adapter, keys)

    def on_l2_keys_deleted(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._add("deleted", adapter, keys)

    def keys(self, kind: str) -> list[ObjectKey]:
        with self._lock:
            return [key for event, _, keys in self.events if event == kind for key in keys]


#: a backend declaring CAPACITY whose adapter has none
_NO_CAPACITY = (
    "declared CAPACITY but the adapter has no capacity (usage() is -1): the backend's capacity()"
    " returned None or raised; return its size in bytes or Capacity(...), or drop CAPACITY"
)


class L2SuiteBase(ComponentSuite):
    """Fixtures and helpers of the L2 suite; the tests are in its subclasses."""

    kind = Kind.L2_ADAPTER
    #: size of the objects the suite stores (a few sizes around it are used too)
    object_size: ClassVar[int] = 16 << 10
    #: bytes of the suite's stand-in L1 arena
    l1_buffer_size: ClassVar[int] = 64 << 20
    #: guard against hangs while waiting for a task; never a performance expectation
    wait_timeout_s: ClassVar[float] = 60.0
    #: capacity tests give up (and fail) if this many objects all fit
    max_fill_objects: ClassVar[int] = 512
    #: keys of the one large batch stored, loaded and deleted (objects of ~object_size/16)
    large_batch: ClassVar[int] = 40
    #: the serde chain the adapter applies, in encoding order: one that changes sizes runs
    #: the suite on records whose stored size is not the object's
    serde: ClassVar[Sequence[Serde]] = ()

    # -- fixtures and hooks a plugin may override ---------------------------------------

    def make_config(self) -> L2AdapterConfig:
        """Config of the adapter under test: the Struct's defaults unless overridden."""
        config_type: Any = self.registered_component().config
        config: L2AdapterConfig = config_type()
        return config

    def make_context(self, config: L2AdapterConfig, l1_buffer: memoryview) -> AdapterContext:
        return AdapterContext(
            index=0,
            name=f"0:{self.component_name}",
            config=config,
            serde=tuple(self.serde),
            l1_buffer=l1_buffer,
        )

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        return create_adapter(
            self.registered_component().load(),
            config,
            self.make_context(config, l1_buffer),
            registry=self.registry(),
            type_name=self.component_name,
        )

    @pytest.fixture
    def l1_buffer(self) -> memoryview:
        return page_aligned_buffer(self.l1_buffer_size)

    @pytest.fixture
    def pool(self, l1_buffer: memoryview) -> BufferPool:
        return BufferPool(l1_buffer)

    @pytest.fixture
    def opened(self) -> Iterator[list[L2Adapter]]:
        """Every adapter a test opened; all closed at teardown."""
        adapters: list[L2Adapter] = []
        yield adapters
        for adapter in adapters:
            adapter.close()

    @pytest.fixture
    def adapter(self, l1_buffer: memoryview, opened: list[L2Adapter]) -> L2Adapter:
        adapter = self.open_adapter(self.make_config(), l1_buffer)
        opened.append(adapter)
        return adapter

    @pytest.fixture
    def reopen_adapter(self, l1_buffer: memoryview, opened: list[L2Adapter]) -> Reopen:
        return lambda previous: self.reopen(previous, l1_buffer, opened)

    def reopen(self, previous: L2Adapter, l1_buffer: memoryview, opened: list[L2Adapter]) -> L2Adapter:
        """Close ``previous`` and open an adapter over the same storage (same config)."""
        config = getattr(previous, "config", None) or self.make_config()
        previous.close()
        adapter = self.open_adapter(config, l1_buffer)
        opened.append(adapter)
        return adapter

    def failing_storage(self, adapter: L2Adapter) -> contextlib.AbstractContextManager[None]:
        """While inside, the store behind ``adapter`` fails (a server stopped, a directory
        made unreadable); on leaving it works again with its objects intact.  A subclass
        declaring ``BACKEND_FAILURES`` provides it."""
        raise NotImplementedError(
            f"{type(self).__name__} declares BACKEND_FAILURES but does not override failing_storage()"
        )

    def damage_stored(self, adapter: L2Adapter, key: ObjectKey) -> None:
        """Change one byte of the object stored under ``key`` where the backend keeps it
        (a file, a row, a server's value), behind the adapter's back: what a disk or a
        network does to a record.  A suite declaring ``DETECTS_DAMAGE`` overrides it."""
        raise NotImplementedError(
            f"{type(self).__name__} declares DETECTS_DAMAGE but does not override damage_stored()"
        )

    # -- helpers ---------------------------------------------------------------------------

    def client(self, adapter: L2Adapter) -> BlockingAdapterClient:
        return BlockingAdapterClient(adapter, timeout=self.wait_timeout_s)

    def sizes(self, count: int) -> list[int]:
        """Object sizes of a batch: not all equal, so a size mix-up shows."""
        return [self.object_size - (index % 3) * 1000 - index for index in range(count)]

    def store(
        self,
        adapter: L2Adapter,
        pool: BufferPool,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int] | None = None,
        *,
        seed: int = 0,
    ) -> tuple[list[bool], list[bytes]]:
        sizes = list(sizes) if sizes is not None else self.sizes(len(keys))
        data = [pattern(seed * 100_003 + index, size) for index, size in enumerate(sizes)]
        buffers = [pool.filled(d) for d in data]
        ok = self.client(adapter).store(keys, buffers)
        # The buffers are L1 objects that stay readable while and after they are stored:
        # a backend that transforms or pads a payload in place corrupts what L1 serves.
        pool.assert_guards_intact(keys, buffers, "store")
        changed = [key for key, buffer, d in zip(keys, buffers, data, strict=True) if bytes(buffer) != d]
        assert not changed, f"a store modified the buffers it stored from ({changed[0]} first)"
        return ok, data

    def stored_bytes(self, keys: Sequence[ObjectKey], data: Sequence[bytes]) -> int:
        """What ``used_bytes`` counts for ``data`` stored under ``keys``: the bytes the
        serde chain encodes them to (the objects' own sizes without a chain)."""
        if not self.serde:
            return sum(map(len, data))
        return sum(
            len(encode_chain(self.serde, memoryview(d), SerdeContext(key=key, size=len(d))))
            for key, d in zip(keys, data, strict=True)
        )

    def load(
        self, adapter: L2Adapter, pool: BufferPool, keys: Sequence[ObjectKey], sizes: Sequence[int]
    ) -> tuple[list[bool], list[bytes]]:
        buffers = [pool.take(size) for size in sizes]
        ok = self.client(adapter).load(keys, buffers)
        pool.assert_guards_intact(keys, buffers)
        return ok, [bytes(b) for b in buffers]

    def lookup_and_load(
        self, adapter: L2Adapter, pool: BufferPool, keys: Sequence[ObjectKey]
    ) -> tuple[list[bool], list[bytes]]:
        """Look ``keys`` up, load the hits into fresh buffers of the sizes found, unlock."""
        result = self.client(adapter).lookup_and_lock(keys)
        loaded, contents = self.load(adapter, pool, keys, [size or self.object_size for size in result.sizes])
        adapter.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])
        return loaded, contents

    @staticmethod
    def raised(adapter: L2Adapter) -> str:
        """Why keys may have missed or failed: the backend calls that raised (or answered a
        result of the wrong length or kind), which core counts as ``backend_errors``."""
        errors = int(adapter.stats().get("backend_errors", 0))
        if not errors:
            return ""
        return f" ({errors} backend calls raised or answered malformed results: backend_errors, see the log)"

    def assert_no_pins(self, adapter: L2Adapter) -> None:
        pinned = getattr(adapter, "pinned_keys", None)
        if pinned is not None:
            assert pinned() == {}, "pins left behind"

    def wait_scanned(self, adapter: L2Adapter) -> None:
        """Wait until the start-up scan of the backend's listing has finished."""
        deadline = time.monotonic() + self.wait_timeout_s
        while adapter.stats().get("scan_running", 0):
            assert time.monotonic() < deadline, "the start-up scan never finished"
            time.sleep(0.01)

    def _check_usage(self, adapter: L2Adapter) -> None:
        usage = adapter.usage()
        if CAPACITY in self.capabilities:
            assert usage != -1.0, _NO_CAPACITY
            assert 0.0 < usage <= 1.0, f"usage {usage} with objects stored: a fraction in (0, 1] was expected"
        else:
            assert usage == -1.0 or 0.0 <= usage <= 1.0

    def _fill(self, adapter: L2Adapter, pool: BufferPool) -> tuple[list[ObjectKey], ObjectKey]:
        """Store single objects until one does not fit; returns (stored, refused)."""
        client = self.client(adapter)
        stored: list[ObjectKey] = []
        for index in range(self.max_fill_objects):
            (key,) = make_keys(1, start=10_000 + index)
            if client.store([key], [pool.filled(pattern(index, self.object_size))]) == [False]:
                return stored, key
            stored.append(key)
        assert adapter.usage() != -1.0, _NO_CAPACITY
        raise AssertionError(
            f"{self.max_fill_objects} objects of {self.object_size} bytes all fit; "
            "configure a smaller capacity for the capacity tests"
        )


class DeflateSerde:
    """A lossless serde whose frames are not their objects' sizes (the suite's random bytes
    grow a little under deflate): ``serde = (DeflateSerde(),)`` runs the suite with slots,
    capacity and restarts accounted on encoded sizes, as a compressing chain stores them."""

    name = "deflate"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.compress(data, 1)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return zlib.decompress(data)


def nonzero(by_salt: dict[str, int]) -> dict[str, int]:
    return {salt: size for salt, size in by_salt.items() if size}
