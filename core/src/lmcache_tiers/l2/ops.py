"""The four batch operations, each split around its backend call.

``prepare`` takes pins and encodes (no backend I/O), the base class runs the backend call
(on a worker thread or the event loop), and ``finish`` accounts, decodes, notifies
listeners and builds the result; ``finish(None)`` means the backend call failed and
releases whatever ``prepare`` took.  ``released`` undoes what a *successful* result still
holds when that result is refused because ``close()`` already failed the task.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import ObjectSize
from lmcache_tiers.l2.buffers import copy_into
from lmcache_tiers.l2.interface import LookupResult
from lmcache_tiers.serde import SerdeContext, decode_chain

if TYPE_CHECKING:
    from lmcache_tiers.l2.core import AdapterCore, ContainsResult

log = logging.getLogger("lmcache_tiers.l2")


class BatchOp(ABC):
    """One submitted batch: ``prepare`` -> backend call -> ``finish``."""

    def __init__(self, core: AdapterCore, keys: Sequence[ObjectKey]) -> None:
        self.core = core
        self.keys = list(keys)
        #: keys (and their positions) that reach the backend call
        self.io_index: list[int] = []

    def io_keys(self) -> list[ObjectKey]:
        return [self.keys[i] for i in self.io_index]

    @abstractmethod
    def prepare(self) -> Any:
        """Take pins, encode: everything before the backend call (no I/O)."""

    @abstractmethod
    def finish(self, io_result: Any) -> Any:
        """Account, decode, notify; ``io_result`` None means the backend call failed."""

    def released(self) -> None:
        """The result was refused (task already failed by close): undo what is held."""
        return None  # optional hook: nothing held by default


class StoreOp(BatchOp):
    def __init__(
        self,
        core: AdapterCore,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> None:
        super().__init__(core, keys)
        self.buffers = [memoryview(buffer).cast("B") for buffer in buffers]
        self.layouts = list(layouts) if layouts is not None else [""] * len(self.keys)
        self.payloads: list[memoryview] = []

    def prepare(self) -> tuple[list[ObjectKey], list[memoryview]]:
        for index, buffer in enumerate(self.buffers):
            try:
                payload = self.core.encode(self.keys[index], buffer, self.layouts[index])
            except Exception as exc:  # a serde refusing one object fails that key only
                self.core.count("serde_encode_failures")
                log.warning("%s: serde encode failed for %s: %s", self.core.name, self.keys[index], exc)
                continue
            self.io_index.append(index)
            self.payloads.append(payload)
        self.core.storing_begin(self.io_keys(), [self.buffers[i].nbytes for i in self.io_index])
        return self.io_keys(), self.payloads

    def finish(self, io_result: Sequence[bool] | None) -> list[bool]:
        ok = [False] * len(self.keys)
        stored: list[ObjectKey] = []
        sizes: list[tuple[ObjectKey, ObjectSize]] = []
        self.core.storing_end(self.io_keys())
        for position, index in enumerate(self.io_index):
            if io_result is not None and io_result[position]:
                ok[index] = True
                key = self.keys[index]
                sizes.append((key, ObjectSize(self.payloads[position].nbytes, self.buffers[index].nbytes)))
                stored.append(key)
        self.core.accounting.record_many(sizes)
        self.core.count("store_keys_ok", len(stored))
        self.core.count("store_keys_failed", len(self.keys) - len(stored))
        self.core.notify("on_l2_keys_stored", stored)
        log.debug("%s: stored %d/%d keys", self.core.name, len(stored), len(self.keys))
        return ok


class LookupOp(BatchOp):
    def __init__(self, core: AdapterCore, keys: Sequence[ObjectKey]) -> None:
        super().__init__(core, keys)
        self.known: list[ObjectSize | None] = []
        self.hits: list[ObjectKey] = []

    def prepare(self) -> list[ObjectKey]:
        pinned = self.core.pins.pin(self.keys)
        self.io_index = [i for i, ok in enumerate(pinned) if ok]
        io_keys = self.io_keys()
        # Snapshot the accounting: a miss only forgets an entry no store replaced since.
        self.known = self.core.accounting.get_many(io_keys)
        return io_keys

    def finish(self, io_result: Sequence[ContainsResult] | None) -> LookupResult:
        found = [False] * len(self.keys)
        sizes = [0] * len(self.keys)
        misses: list[ObjectKey] = []
        for position, index in enumerate(self.io_index):
            key = self.keys[index]
            reported = io_result[position] if io_result is not None else None
            size = self.core.resolve_size(key, reported, self.known[position])
            if size is None:
                misses.append(key)
                if io_result is not None and reported is None:
                    self.core.accounting_forget_if_unchanged(key, self.known[position])
                continue
            found[index] = True
            sizes[index] = size.l1
            self.hits.append(key)
        self.core.pins.unpin(misses)
        self.core.count("lookup_hits", len(self.hits))
        self.core.count("lookup_misses", len(self.keys) - len(self.hits))
        log.debug("%s: lookup found %d/%d keys", self.core.name, len(self.hits), len(self.keys))
        return LookupResult(found, sizes)

    def released(self) -> None:
        self.core.pins.unpin(self.hits)


class LoadOp(BatchOp):
    def __init__(self, core: AdapterCore, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> None:
        super().__init__(core, keys)
        self.buffers = list(buffers)
        self.targets: list[memoryview] = []
        self.sizes: list[ObjectSize | None] = []
        self.pinned: list[ObjectKey] = []

    def prepare(self) -> tuple[list[ObjectKey], list[memoryview]]:
        # The load's own pin keeps a concurrent delete off the bytes while they are copied,
        # even for a caller that loads without a lookup.
        pinned = self.core.pins.pin(self.keys)
        self.pinned = [key for key, ok in zip(self.keys, pinned, strict=True) if ok]
        known = iter(self.core.accounting.get_many(self.pinned))
        for index, ok in enumerate(pinned):
            if not ok:
                continue
            buffer = memoryview(self.buffers[index]).cast("B")
            size = next(known)
            if size is not None and size.l1 != buffer.nbytes:
                log.warning(
                    "%s: load buffer of %d bytes for %s, object needs %d",
                    self.core.name,
                    buffer.nbytes,
                    self.keys[index],
                    size.l1,
                )
                continue
            if self.core.identity:
                target = buffer
            elif size is None:
                continue  # the encoded size is unknown: the caller skipped the lookup
            else:
                target = memoryview(bytearray(size.stored))
            self.io_index.append(index)
            self.targets.append(target)
            self.sizes.append(size)
        return self.io_keys(), self.targets

    def finish(self, io_result: Sequence[bool] | None) -> list[bool]:
        ok = [False] * len(self.keys)
        loaded: list[ObjectKey] = []
        try:
            for position, index in enumerate(self.io_index):
                if io_result is None or not io_result[position]:
                    continue
                if not self.core.identity and not self._decode_into(position, index):
                    continue
                ok[index] = True
                loaded.append(self.keys[index])
        finally:
            self.core.pins.unpin(self.pinned)
        self.core.count("load_keys_ok", len(loaded))
        self.core.count("load_keys_failed", len(self.keys) - len(loaded))
        self.core.notify("on_l2_keys_loaded", loaded)
        log.debug("%s: loaded %d/%d keys", self.core.name, len(loaded), len(self.keys))
        return ok

    def _decode_into(self, position: int, index: int) -> bool:
        buffer = memoryview(self.buffers[index]).cast("B")
        try:
            context = SerdeContext(self.keys[index], buffer.nbytes)
            decoded = decode_chain(self.core.serde, self.targets[position], context)
            if decoded.nbytes != buffer.nbytes:
                raise ValueError(f"decoded {decoded.nbytes} bytes, expected {buffer.nbytes}")
            copy_into(buffer, decoded)
        except Exception as exc:  # tampered or damaged payload: a miss, not garbage
            self.core.count("serde_decode_failures")
            log.warning("%s: serde decode failed for %s: %s", self.core.name, self.keys[index], exc)
            return False
        return True


class DeleteOp(BatchOp):
    def prepare(self) -> list[ObjectKey]:
        claimed = self.core.pins.begin_delete(self.keys)
        self.io_index = [i for i, ok in enumerate(claimed) if ok]
        self.core.count("delete_keys_skipped", len(self.keys) - len(self.io_index))
        return self.io_keys()

    def finish(self, io_result: Sequence[bool] | None) -> list[bool]:
        ok = [False] * len(self.keys)
        deleted: list[ObjectKey] = []
        try:
            for position, index in enumerate(self.io_index):
                if io_result is not None and io_result[position]:
                    ok[index] = True
                    key = self.keys[index]
                    self.core.accounting.forget(key)
                    deleted.append(key)
        finally:
            self.core.pins.end_delete(self.io_keys())
        self.core.count("delete_keys_ok", len(deleted))
        self.core.notify("on_l2_keys_deleted", deleted)
        return ok
