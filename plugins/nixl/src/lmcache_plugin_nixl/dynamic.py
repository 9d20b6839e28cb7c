"""``nixl_store_dynamic``: one checksummed record file per object, kept across restarts.

Files are opened and registered with NIXL per batch and closed after it, so the number
of objects is not bounded by the open-file limit.  Names, layout, atomic publish,
start-up sweep, listing and the single-server lock are core's shared file-store code
(:mod:`lmcache_tiers.l2.files`, also used by ``fs``); only the bytes move through NIXL.
The backend keeps no index: a lookup checks the key's deterministic file (its size minus
the header's is the stored size), and ``list_keys`` lists the directory with file sizes,
from which core accounts what an earlier run stored as soon as the adapter starts.
Capacity (``max_capacity_gb``) is checked by core.  A record whose header or checksum
does not verify is a miss and its file is removed (``corrupt_records_removed``); an
intact record written with another serde chain is a miss that is kept
(``serde_chain_mismatch``, see the adapter docs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from stat import S_ISREG

from lmcache_plugin_nixl.availability import check_before_l1, check_direct_io
from lmcache_plugin_nixl.config import FILE_PATH_FIELD, NixlStoreDynamicConfig
from lmcache_plugin_nixl.lifetime import CallLifetime, count_load_stopped_closing, count_store_stopped_closing
from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.recordio import RecordFiles
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.transfers import BatchTransfer
from lmcache_tiers.plugin import (
    ABSENT_FILE_ERRORS,
    BackendContext,
    ConfigError,
    DirectoryLock,
    FileLayout,
    LocalFiles,
    ObjectKey,
    ObjectSize,
    check_directory_free,
    identity_of,
    warn_if_root_folds_case,
)

log = logging.getLogger(__name__)


def _lock_what(directory: str) -> str:
    """How the directory lock and its pre-flight probe name the directory."""
    return f"the nixl_store_dynamic directory {directory}"


class NixlDynamicBackend:
    """Backend writing one NIXL-transferred record file per object."""

    @staticmethod
    def preflight(config: NixlStoreDynamicConfig) -> None:
        """Before L1 exists: the directory is usable and no other server (or adapter)
        holds it; the backend's native libraries are there."""
        config.preflight()
        check_directory_free(config.file_path, FILE_PATH_FIELD, what=_lock_what(config.file_path))
        check_before_l1(config.backend, config.nixl_init_params())

    def __init__(self, config: NixlStoreDynamicConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._capacity = config.max_capacity_bytes
        runtime = NixlRuntime.shared()
        runtime.ensure_backend(config.backend, config.nixl_init_params())
        try:
            self._dir_lock = DirectoryLock(config.file_path, what=_lock_what(config.file_path))
        except OSError as exc:
            raise ConfigError(
                f"nixl_store_dynamic: cannot use {config.file_path}: {exc.strerror or exc}"
            ) from exc
        try:
            self.layout = FileLayout(self._dir_lock.root, shard_dirs=config.shard_dirs)
            self.files = LocalFiles(
                self.layout,
                name=context.name,
                count=context.count,
                on_root_recreated=self._dir_lock.root_recreated,
                removals=context,
            )
            if config.use_direct_io:
                check_direct_io(self.layout.root)
            self.files.remove_temp_files()
            # Record names are fs's: keys differing only in case share a file where the
            # filesystem folds case, which is told here and flagged in the stats.
            self._folds_case = warn_if_root_folds_case(self.layout.root, context.name)
            self._host = HostMemory(runtime, config.backend, context.l1_buffer)
        except BaseException:
            self._dir_lock.release()
            raise
        transfer = BatchTransfer(runtime, config.backend, self._host, "FILE", direct_io=config.use_direct_io)
        self._overdue = transfer.overdue
        self._records = RecordFiles(
            runtime,
            transfer,
            self.files,
            context,
            direct_io=config.use_direct_io,
            # NIXL's POSIX backend reading into host memory is a copy out of the page cache:
            # preadv does the same copy without the request set-up (plainreads.py).
            plain_reads=config.backend == "POSIX" and not config.use_direct_io,
        )
        # The host memory's registrations (the L1 arena, pinned header staging) and the
        # directory lock outlive every store and load using them (lifetime.py).
        self._calls = CallLifetime(context, "the L1 arena's registration and the directory", self._release)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        if not self._calls.enter():
            count_store_stopped_closing(self.context, len(keys))
            return [False] * len(keys)
        try:
            return self._records.write(keys, payloads)
        finally:
            self._calls.leave()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return [self._stored_size(key) for key in keys]

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Sequence[int | ObjectSize | None] | None:
        """Misses told from memory: the directory is this process's alone (its
        ``DirectoryLock``), so once core's start-up scan listed it, a key core does not
        account has no record file.  A batch with any accounted key goes to
        ``contains_many``, which looks at the file."""
        return self.context.misses_now(keys)

    def _stored_size(self, key: ObjectKey) -> int | ObjectSize | None:
        try:
            stat = os.stat(self.layout.path_for(key))
        except ABSENT_FILE_ERRORS:
            return None  # other errors fail the lookup batch
        if not S_ISREG(stat.st_mode):
            # A directory (or another kind of file) someone made at the record's name holds
            # no record: the key is absent -- not a hit of its size (4096 on ext4, a
            # header's length), nor a damaged record to remove.
            return None
        stored = stat.st_size - self._records.header_length(key)
        if stored < 0:
            self.files.discard(key, identity_of(stat), "truncated_records_removed", "shorter than its header")
            return None
        if self.context.l1_size_of(key) is not None:
            return stored
        # A key core has no L1 size for: only the header knows it under a size-changing
        # chain, and whether the record is of this key at all (keys that differ only in
        # case share a file on a case-insensitive filesystem; a hit would be adopted).
        return self._records.size_from_header(key)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        if not self._calls.enter():
            count_load_stopped_closing(self.context, len(keys))
            return [False] * len(keys)
        try:
            return self._records.read(keys, buffers)
        finally:
            self._calls.leave()

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [self.files.delete(key) for key in keys]

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        # Records shorter than their header are removed (and counted) as they are listed.
        return self.files.iter_records(self._records.header_length)

    def stats(self) -> dict[str, int]:
        """The overdue transfers, and ``case_insensitive_root``: 1 when the directory's
        filesystem folds letter case in names, so keys that differ only in case replace
        each other's records (told at start-up too)."""
        return {**self._overdue.stats(), "case_insensitive_root": int(self._folds_case)}

    def capacity(self) -> int:
        return self._capacity

    def close(self) -> None:
        """Refuse further stores and loads; deregister the host memory and unlock the
        directory now if no call runs, else once the last one leaves.  Never waits for a
        call: one still inside its NIXL transfer keeps the registration its request was
        built on, and the directory (no other server takes it while the call may still
        write there).  The files a call opened are its own, closed when it leaves.

        Without persistence the records are removed by whoever releases the directory,
        while it is still this adapter's: a rename that passed its closing check before
        close may land after any sweep made while calls are inside.  Such a sweep is made
        too (a call stuck for good never leaves); a second close sweeps nothing, as the
        directory may be another server's by then."""
        try:
            if not self.config.persist_enabled and not self._calls.closed and self._calls.busy:
                self._remove_records("stores or loads still inside")
        finally:
            try:
                self._records.close()
            finally:
                self._calls.close()

    def _release(self) -> None:
        """Run once, by the first close or by the last call to leave after it."""
        try:
            if not self.config.persist_enabled:
                self._remove_records("the directory is released")
        finally:
            try:
                self._host.close()
            finally:
                self._dir_lock.release()

    def _remove_records(self, when: str) -> None:
        removed = self.files.remove_all_records()
        log.info("%s: persistence off, removed %d record files (%s)", self.context.name, removed, when)
