"""``nixl_store_dynamic``: one checksummed record file per object, kept across restarts.

Files are opened and registered with NIXL per batch and closed after it, so the number
of objects is not bounded by the open-file limit.  The backend keeps no index: a lookup
checks the key's deterministic file (its size minus the header's is the stored size),
and ``list_keys`` lists the directory with file sizes, from which core accounts what an
earlier run stored as soon as the adapter starts.  Capacity (``max_capacity_gb``) is
checked by core.  A record whose header or checksum does not verify is a miss and its
file is removed (``corrupt_records_removed``); an intact record written with another
serde chain is a miss that is kept (``serde_chain_mismatch``, see the adapter docs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

from lmcache_plugin_nixl.availability import check_direct_io
from lmcache_plugin_nixl.config import NixlStoreDynamicConfig
from lmcache_plugin_nixl.dirlock import DirectoryLock
from lmcache_plugin_nixl.layout import FileLayout
from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.recordio import RecordFiles
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.transfers import BatchTransfer
from lmcache_tiers.plugin import BackendContext, ObjectKey, ObjectSize, RecordError

log = logging.getLogger(__name__)

DYNAMIC_LOCK_NAME = ".lmcache-nixl-dynamic.lock"


class NixlDynamicBackend:
    """Backend writing one NIXL-transferred record file per object."""

    def __init__(self, config: NixlStoreDynamicConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
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
                log.info("%s: removed %d temporary files left by an interrupted run", context.name, orphans)
            context.count("orphan_temp_files_removed", orphans)
            self._host = HostMemory(runtime, config.backend, context.l1_buffer)
        except BaseException:
            self._dir_lock.release()
            raise
        transfer = BatchTransfer(runtime, config.backend, self._host, "FILE")
        self._records = RecordFiles(runtime, transfer, self.layout, context, direct_io=config.use_direct_io)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return self._records.write(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return [self._stored_size(key) for key in keys]

    def _stored_size(self, key: ObjectKey) -> int | ObjectSize | None:
        try:
            stored = os.stat(self.layout.path_for(key)).st_size - self._records.header_length(key)
        except OSError:
            return None
        if stored < 0:
            return None
        if not self.context.serde or self.context.l1_size_of(key) is not None:
            return stored
        # A size-changing chain and a key core has no L1 size for: only the header knows.
        header = self._records.peek_header(key)
        if isinstance(header, RecordError):
            self._discard(key, header)
            return None
        return None if header is None else ObjectSize(header.payload_len, header.l1_size)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        outcomes = self._records.read(keys, buffers)
        for key, outcome in zip(keys, outcomes, strict=True):
            if isinstance(outcome, RecordError):
                self._discard(key, outcome)
        return [outcome is True for outcome in outcomes]

    def _discard(self, key: ObjectKey, error: RecordError) -> None:
        """Remove a record that failed verification: it is a miss from now on."""
        self.context.count("corrupt_records_removed")
        log.warning("%s: removing %s: %s", self.context.name, key.file_stem(), error)
        try:
            os.unlink(self.layout.path_for(key))
        except FileNotFoundError:
            pass

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        results: list[bool] = []
        for key in keys:
            try:
                os.unlink(self.layout.path_for(key))
                results.append(True)
            except FileNotFoundError:
                results.append(False)
            except OSError as exc:
                log.warning("%s: cannot delete %s: %s", self.context.name, key.file_stem(), exc)
                results.append(False)
        return results

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        # A file shorter than its header is left to the lookup that finds it.
        for key, file_size in self.layout.iter_records():
            stored = file_size - self._records.header_length(key)
            if stored >= 0:
                yield key, stored

    def capacity(self) -> int:
        return self._capacity

    def close(self) -> None:
        try:
            if not self.config.persist_enabled:
                removed = self.layout.remove_all_records()
                log.info("%s: persistence off, removed %d record files", self.context.name, removed)
        finally:
            self._records.close()
            self._host.close()
            self._dir_lock.release()
