"""``nixl_store_dynamic``: one checksummed record file per object, kept across restarts.

Files are opened and registered with NIXL per batch and closed after it, so the number
of objects is not bounded by the open-file limit.  The in-memory index (key -> stored
bytes) starts empty after a restart: a lookup that misses it checks for the key's
deterministic file and, if it exists, counts a hit and adds the key from the file size.
``iter_keys`` lists the directory, so eviction also sees records not looked up yet.
Usage is stored bytes over ``max_capacity_gb``; a store that would go beyond it is
refused.  Deletes (eviction included) remove files; the base class keeps pinned keys
from being deleted.  A record whose header or checksum does not verify is a miss and its
file is removed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence

from lmcache_plugin_nixl.availability import check_direct_io
from lmcache_plugin_nixl.config import NixlStoreDynamicConfig
from lmcache_plugin_nixl.dirlock import DirectoryLock
from lmcache_plugin_nixl.layout import FileLayout
from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.recordio import RecordFiles
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.transfers import BatchTransfer
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.base import BatchL2Adapter, ContainsResult, ObjectSize
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.record import RecordError
from lmcache_tiers.serde import serde_names

log = logging.getLogger(__name__)

DYNAMIC_LOCK_NAME = ".lmcache-nixl-dynamic.lock"


class NixlDynamicAdapter(BatchL2Adapter):
    """L2 adapter writing one NIXL-transferred record file per object."""

    def __init__(self, config: NixlStoreDynamicConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.nixl_config = config
        self._capacity = config.max_capacity_bytes
        runtime = NixlRuntime.shared()
        runtime.ensure_backend(config.backend, config.nixl_init_params())
        self.layout = FileLayout(config.file_path, shard_dirs=config.shard_dirs)
        os.makedirs(self.layout.root, exist_ok=True)
        self._dir_lock = DirectoryLock(self.layout.root, DYNAMIC_LOCK_NAME)
        try:
            if config.use_direct_io:
                check_direct_io(self.layout.root)
            orphans = self.layout.remove_temp_files()
            if orphans:
                log.info("%s: removed %d temporary files left by an interrupted run", self.name, orphans)
            self.count("orphan_temp_files_removed", orphans)
            arena = context.l1_buffer if context.l1_is_memory else None
            self._host = HostMemory(runtime, config.backend, arena)
        except BaseException:
            self._dir_lock.release()
            raise
        transfer = BatchTransfer(runtime, config.backend, self._host, "FILE")
        self._records = RecordFiles(
            runtime,
            transfer,
            self.layout,
            direct_io=config.use_direct_io,
            serde_names=serde_names(self.serde),
        )
        self._lock = threading.Lock()
        self._index: dict[ObjectKey, int] = {}
        self._used = 0  # bytes of indexed objects
        self._reserved = 0  # bytes of stores in flight
        # L1 sizes of objects being stored, for headers when a serde chain changes sizes
        # (put_many only sees the encoded payloads).
        self._l1_sizes: dict[ObjectKey, int] = {}

    # -- store ------------------------------------------------------------------------------

    def submit_store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> int:
        self.validate_batch(keys, buffers, layouts)
        if not self.identity:
            with self._lock:
                for key, buffer in zip(keys, buffers, strict=True):
                    self._l1_sizes[key] = memoryview(buffer).nbytes
        return super().submit_store(keys, buffers, layouts)

    def _reserve(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[int]:
        accepted: list[int] = []
        with self._lock:
            for index, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
                growth = payload.nbytes - self._index.get(key, 0)
                if self._used + self._reserved + growth > self._capacity:
                    continue
                self._reserved += payload.nbytes
                accepted.append(index)
        return accepted

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        accepted = self._reserve(keys, payloads)
        refused = len(keys) - len(accepted)
        if refused:
            self.count("capacity_refusals", refused)
        with self._lock:
            l1_sizes = [self._l1_sizes.pop(keys[i], payloads[i].nbytes) for i in accepted]
        results = [False] * len(keys)
        written: list[bool] = [False] * len(accepted)
        try:
            written = self._records.write(
                [keys[i] for i in accepted], [payloads[i] for i in accepted], l1_sizes
            )
        finally:
            with self._lock:
                for index, ok in zip(accepted, written, strict=True):
                    size = payloads[index].nbytes
                    self._reserved -= size
                    if ok:
                        self._used += size - self._index.get(keys[index], 0)
                        self._index[keys[index]] = size
                        results[index] = True
        return results

    # -- lookup -----------------------------------------------------------------------------

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[ContainsResult]:
        with self._lock:
            known = [self._index.get(key) for key in keys]
        return [
            size if size is not None else self._recover(key) for key, size in zip(keys, known, strict=True)
        ]

    def _recover(self, key: ObjectKey) -> ObjectSize | None:
        """Find a record this process has not indexed (written before a restart)."""
        path = self.layout.path_for(key)
        try:
            file_size = os.stat(path).st_size
        except OSError:
            return None
        stored = file_size - self._records.header_length(key)
        if stored < 0:
            return None
        size = ObjectSize(stored, stored)
        if not self.identity:
            # The L1 size differs from the stored one; only the header knows it.
            header = self._records.peek_header(key)
            if isinstance(header, RecordError):
                self._discard(key, header)
                return None
            if header is None:
                return None
            size = ObjectSize(header.payload_len, header.l1_size)
        with self._lock:
            if key not in self._index:
                self._index[key] = size.stored
                self._used += size.stored
        self.count("recovered_keys")
        return size

    # -- load -------------------------------------------------------------------------------

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        outcomes = self._records.read(keys, buffers)
        results: list[bool] = []
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, RecordError):
                self._discard(key, outcome)
            elif outcome is None:
                self._forget(key)
            results.append(outcome is True)
        return results

    def _discard(self, key: ObjectKey, error: RecordError) -> None:
        """Remove a record that failed verification: it is a miss from now on."""
        self.count("corrupt_records_removed")
        log.warning("%s: removing %s: %s", self.name, key.file_stem(), error)
        try:
            os.unlink(self.layout.path_for(key))
        except FileNotFoundError:
            pass
        self._forget(key)

    def _forget(self, key: ObjectKey) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    # -- delete, listing, capacity ------------------------------------------------------------

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        results: list[bool] = []
        for key in keys:
            try:
                os.unlink(self.layout.path_for(key))
                removed = True
            except FileNotFoundError:
                removed = False
            except OSError as exc:
                log.warning("%s: cannot delete %s: %s", self.name, key.file_stem(), exc)
                results.append(False)
                continue
            self._forget(key)
            results.append(removed)
        return results

    def iter_keys(self) -> Iterator[ObjectKey]:
        # From the directory, not the index: after a restart the index holds only what was
        # looked up since, while eviction must see every record on disk.
        return self.layout.iter_keys()

    def capacity_bytes(self) -> int | None:
        return self._capacity

    def close_backend(self) -> None:
        try:
            if not self.nixl_config.persist_enabled:
                removed = self.layout.remove_all_records()
                log.info("%s: persistence off, removed %d record files", self.name, removed)
        finally:
            self._records.close()
            self._host.close()
            self._dir_lock.release()
