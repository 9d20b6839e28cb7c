"""The in-memory backend behind the ``mock`` type.

Objects of 64 KiB and more live in one memory pool per namespace: an anonymous mapping
of the configured capacity, carved into page-aligned extents, whose pages are reused
when objects are deleted or replaced.  A fresh ``bytes`` per stored object would make
every store fault in new pages (under 1 GB/s on some VMs, slower than the copy itself)
and would copy with the GIL held; the pool is written with ``copy_into``, which releases
it.  Smaller objects, and one the pool has no extent for (fragmentation, or a namespace
shared with an adapter configured larger), are kept as ``bytes``.  What fits is decided
by core, against ``max_size_gb``, before a store reaches the backend.

Extents are claimed and objects published under the namespace lock; the bytes are copied
outside it, so a lookup never waits for another key's copy.  An extent being read by a
load is freed only when that load is done with it, even if the key is overwritten or
deleted meanwhile.
"""

from __future__ import annotations

import errno
import logging
import mmap
import threading
from collections.abc import Sequence

from lmcache_plugin_mock import MockConfig
from lmcache_tiers.plugin import (
    BackendContext,
    ExtentAllocator,
    FieldError,
    ObjectKey,
    check_claimed_once,
    copy_into,
)

logger = logging.getLogger(__name__)

#: pool extents are whole pages, so objects never share one
_ALIGN = mmap.PAGESIZE
#: smaller objects are kept as ``bytes``: malloc serves them from memory it already
#: touched, faster than the pool's extent bookkeeping, and they are copied with the GIL
#: held either way (see ``copy_into``)
_POOL_MIN_BYTES = 64 << 10
# Not exported by the mmap module before Python 3.13; the value is fixed by the Linux ABI.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def pool_bytes(capacity: int) -> int:
    """The size of the pool of a namespace of ``capacity`` bytes.

    Headroom over the capacity (which counts bytes, not extents) for extents rounded up to
    pages and for overwrites, whose old and new bytes coexist until the new ones are
    published; without it such objects would spill to the heap."""
    return capacity + capacity // 8


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Pool:
    """A mapping for ``capacity`` bytes and the allocator of its extents (namespace lock)."""

    def __init__(self, capacity: int, *, prefault: bool) -> None:
        self.allocator = ExtentAllocator(pool_bytes(capacity), align=_ALIGN)
        # Anonymous and private: pages cost nothing until first written.
        self.memory = mmap.mmap(-1, self.allocator.capacity)
        self.view = memoryview(self.memory)
        if prefault:
            self._prefault()

    def _prefault(self) -> None:
        try:
            self.memory.madvise(_MADV_POPULATE_WRITE)
            return
        except OSError as exc:  # kernels before 5.14: write one byte per page instead
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
        for offset in range(0, len(self.memory), mmap.PAGESIZE):
            self.view[offset] = 0

    def allocate(self, size: int) -> int | None:
        offsets = self.allocator.allocate_many([size])
        return None if offsets is None else offsets[0]


class _Object:
    """One stored object: an extent of a pool, or ``bytes`` (small, or no room in the pool)."""

    __slots__ = ("chain", "heap", "offset", "pool", "readers", "retired", "size")

    def __init__(self, size: int, pool: _Pool | None, offset: int, chain: tuple[str, ...]) -> None:
        self.size = size
        self.pool = pool
        self.offset = offset
        #: the serde chain that encoded the bytes (``BackendContext.serde_names``): an
        #: adapter reopening the namespace with another chain must not decode them
        self.chain = chain
        self.heap = b""
        #: loads copying out of the object right now
        self.readers = 0
        #: deleted or replaced; its extent is freed once no load reads it
        self.retired = False

    def view(self) -> memoryview:
        if self.pool is None:
            return memoryview(self.heap)
        return self.pool.view[self.offset : self.offset + self.size]

    def free_if_unread(self) -> None:
        if self.retired and self.readers == 0 and self.pool is not None:
            self.pool.allocator.free_many([self.offset])
            self.pool = None


class _Objects:
    """One namespace's objects and the pool they live in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[ObjectKey, _Object] = {}
        self.pool: _Pool | None = None
        self.pool_tried = False

    def ensure_pool(self, capacity: int, *, prefault: bool) -> None:
        """Create the pool once, sized by the first adapter of the namespace."""
        with self.lock:
            if self.pool_tried:
                return
            self.pool_tried = True
            if capacity < _POOL_MIN_BYTES:
                return
            try:
                self.pool = _Pool(capacity, prefault=prefault)
            except OSError as exc:
                # No address space or commit charge for it (e.g. strict overcommit):
                # every object goes to the heap, as it would without a pool.
                logger.warning("mock: no memory pool of %d bytes (%s); objects go to the heap", capacity, exc)
                self.pool = None

    def retire(self, obj: _Object) -> None:
        """Call with ``lock`` held: ``obj`` left ``data``; free it unless a load reads it."""
        obj.retired = True
        obj.free_if_unread()

    def close(self) -> None:
        """Drop every object and the pool (an adapter without a namespace is closing).

        The mapping is unmapped once nothing refers to it any more: a backend call that
        outlived ``close()`` still holds its objects' pool.
        """
        with self.lock:
            for obj in self.data.values():
                self.retire(obj)
            self.data.clear()
            self.pool = None


_NAMESPACES: dict[str, _Objects] = {}
_NAMESPACES_LOCK = threading.Lock()


def _objects_for(namespace: str | None) -> _Objects:
    if namespace is None:
        return _Objects()
    with _NAMESPACES_LOCK:
        return _NAMESPACES.setdefault(namespace, _Objects())


class MockBackend:
    """Keeps payloads in process memory; capacity, bandwidth and latency as configured."""

    @staticmethod
    def preflight(config: MockConfig) -> None:
        """Two adapters of one server on one namespace would each account and evict the
        other's objects as its own (bytes counted twice, removals behind its back).  A
        pool pre-faulted whole at open must fit in the memory available: past it, the
        kernel's OOM killer ends a process instead of the start-up refusing."""
        capacity = int(config.max_size_gb * (1 << 30))
        available = _mem_available()
        if config.prefault and capacity >= _POOL_MIN_BYTES and available is not None:
            touched = pool_bytes(capacity)
            if touched > available:
                raise FieldError(
                    "max_size_gb",
                    f"prefault would touch {touched / (1 << 30):.1f} GiB (max_size_gb and an eighth "
                    f"more for page rounding), more than the {available / (1 << 30):.1f} GiB of "
                    "memory available (MemAvailable); lower max_size_gb or leave prefault off",
                )
        if config.namespace is not None:
            check_claimed_once(
                f"mock namespace {config.namespace}",
                "namespace",
                f"mock namespace {config.namespace!r} is already used by another adapter of this "
                "server; give each adapter its own namespace",
            )

    def __init__(self, config: MockConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._capacity = int(config.max_size_gb * (1 << 30))
        self._objects = _objects_for(config.namespace)
        self._objects.ensure_pool(self._capacity, prefault=config.prefault)

    def _simulate(self, nbytes: int) -> bool:
        """Spend the simulated time of a call moving ``nbytes``; False if closed meanwhile."""
        seconds = self.config.latency_s
        if self.config.bandwidth_bytes_per_s:
            seconds += nbytes / self.config.bandwidth_bytes_per_s
        return self.context.sleep(seconds)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        if not self._simulate(sum(p.nbytes for p in payloads)):
            return [False] * len(keys)
        objects = self._objects
        claimed: list[_Object] = []
        chain = self.context.serde_names
        with objects.lock:
            pool = objects.pool
            for payload in payloads:
                offset = None
                if pool is not None and payload.nbytes >= _POOL_MIN_BYTES:
                    offset = pool.allocate(payload.nbytes)
                claimed.append(
                    _Object(payload.nbytes, pool if offset is not None else None, offset or 0, chain)
                )
        try:
            for obj, payload in zip(claimed, payloads, strict=True):
                if obj.pool is None:
                    obj.heap = bytes(payload)
                else:
                    copy_into(obj.view(), payload)
        except BaseException:
            with objects.lock:
                for obj in claimed:
                    objects.retire(obj)
            raise
        with objects.lock:
            for key, obj in zip(keys, claimed, strict=True):
                # Whatever holds the key now (a concurrent store or delete may have
                # changed it during the copy) is what this store replaces.
                replaced = objects.data.get(key)
                objects.data[key] = obj
                if replaced is not None:
                    objects.retire(replaced)
        return [True] * len(keys)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        self._simulate(0)
        with self._objects.lock:
            found = [self._objects.data.get(key) for key in keys]
        readable = self._readable(keys, found)
        return [obj.size if obj is not None and ok else None for obj, ok in zip(found, readable, strict=True)]

    def _readable(self, keys: Sequence[ObjectKey], found: Sequence[_Object | None]) -> list[bool]:
        """Which objects this chain can decode.  One stored by an adapter of another serde
        chain (the namespace reopened as after a restart with the chain changed) is a
        miss, counted and logged, and kept -- as a record store treats a record of another
        chain -- never decoded into wrong bytes."""
        chain = self.context.serde_names
        readable = []
        for key, obj in zip(keys, found, strict=True):
            if obj is not None and obj.chain != chain:
                self.context.serde_chain_mismatch(key, obj.chain)
                readable.append(False)
            else:
                readable.append(True)
        return readable

    @property
    def answers_lookups_now(self) -> bool:
        """Whether ``contains_many_now`` ever answers: not with a simulated latency."""
        return not self.config.latency_s

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[int | None] | None:
        """The namespace is in memory: answered on the caller's thread -- unless a
        simulated latency makes lookups slow on purpose, or another thread holds the
        namespace lock right now."""
        if self.config.latency_s or not self._objects.lock.acquire(blocking=False):
            return None
        try:
            found = [self._objects.data.get(key) for key in keys]
        finally:
            self._objects.lock.release()
        chain = self.context.serde_names
        if any(obj is not None and obj.chain != chain for obj in found):
            return None  # another chain's objects: counted and logged by contains_many
        return [None if obj is None else obj.size for obj in found]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        objects = self._objects
        with objects.lock:
            found = [objects.data.get(key) for key in keys]
            for obj in found:
                if obj is not None:
                    obj.readers += 1
        try:
            if not self._simulate(sum(obj.size for obj in found if obj is not None)):
                return [False] * len(keys)
            readable = self._readable(keys, found)
            ok: list[bool] = []
            for obj, buffer, decodable in zip(found, buffers, readable, strict=True):
                if obj is None or not decodable or obj.size != buffer.nbytes:
                    ok.append(False)
                    continue
                copy_into(buffer, obj.view())
                ok.append(True)
            return ok
        finally:
            with objects.lock:
                for obj in found:
                    if obj is not None:
                        obj.readers -= 1
                        obj.free_if_unread()

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._simulate(0)
        objects = self._objects
        ok: list[bool] = []
        with objects.lock:
            for key in keys:
                obj = objects.data.pop(key, None)
                if obj is not None:
                    objects.retire(obj)
                ok.append(obj is not None)
        return ok

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self._objects.lock:
            return [(key, obj.size) for key, obj in self._objects.data.items()]

    def capacity(self) -> int:
        return self._capacity

    def close(self) -> None:
        if self.config.namespace is None:
            self._objects.close()
