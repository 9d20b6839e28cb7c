"""``fs``: the backend core wraps into an adapter.

Local directories (plain paths, ``file://``) are served with ``os`` calls
(:mod:`~lmcache_plugin_fs.local_io`), every other fsspec URL through fsspec
(:mod:`~lmcache_plugin_fs.remote`); both keep the same records in the same layout.  The
backend keeps no index: a lookup checks the key's deterministic file (its size minus the
header's is the stored size), and ``list_keys`` lists the tree with file sizes, from which
core accounts what an earlier run stored as soon as the adapter starts.  Capacity is
checked by core; eviction (``eviction``) is core's L2 eviction controller deleting files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

from lmcache_plugin_fs import FsConfig
from lmcache_plugin_fs.local_io import LocalRecords
from lmcache_plugin_fs.remote import RemoteRecords, shown
from lmcache_plugin_fs.rename_probe import check_renames_into_root
from lmcache_plugin_fs.temp_dirs import TempDirRecord
from lmcache_plugin_fs.unrecorded_temp_dirs import report_unrecorded_in_listing, report_unrecorded_temp_dirs
from lmcache_tiers.plugin import (
    BackendContext,
    BackendUnavailableError,
    ConfigError,
    DirectoryLock,
    FileLayout,
    LocalFiles,
    ObjectKey,
    ObjectSize,
    ProcessClaim,
    WriteFailures,
    check_directory,
    check_directory_free,
    check_process_claim_free,
    check_relative_dir,
    direct_io_refusal,
    redact_url_secrets,
    warn_if_root_folds_case,
)

log = logging.getLogger(__name__)


def _lock_what(root: str) -> str:
    """How the directory lock and its pre-flight probe name a local root."""
    return f"the fs directory {root}"


def _temp_what(directory: str) -> str:
    """How the lock of a local ``relative_tmp_dir`` and its pre-flight probe name it."""
    return f"the temporary directory {directory} of an fs store"


def _local_temp_dir(config: FsConfig) -> str | None:
    """The local ``relative_tmp_dir`` of ``config`` as a path to lock, or None: none is
    set, or it leads back to the root (a symbolic link), which the root's lock holds --
    locked again, the adapter would refuse itself as another adapter."""
    if not config.is_local or config.relative_tmp_dir is None:
        return None
    temp_dir = os.path.join(config.local_root, check_relative_dir(config.relative_tmp_dir))
    if os.path.realpath(temp_dir) == os.path.realpath(config.local_root):
        return None
    return temp_dir


def _store_what(root: str) -> str:
    """How the claim of a remote store and its pre-flight probe name it."""
    return f"the fs store {shown(root)}"


def _store_identity(protocol: str | Sequence[str], root: str) -> str:
    """What an adapter of this process claims of an fsspec store: the protocol's first
    name and the path fsspec reduces the URL to (so ``s3a://b/p`` and ``s3://b/p/`` are
    one store)."""
    name = protocol if isinstance(protocol, str) else protocol[0]
    return f"{name}://{root}"


def _remote_identity(url: str) -> str | None:
    """``_store_identity`` of a remote root from its filesystem class, without building
    the filesystem (which may connect somewhere); None for a URL only the open resolves
    (chained, or a protocol not installed: the open says so)."""
    import fsspec

    if "::" in url:
        return None
    protocol, _ = fsspec.core.split_protocol(url)
    try:
        kind = fsspec.get_filesystem_class(protocol)
        return _store_identity(kind.protocol, kind._strip_protocol(url))
    except (ImportError, ValueError):
        return None


class FsBackend:
    """One record file per object under ``config.root``."""

    @staticmethod
    def preflight(config: FsConfig) -> None:
        """Before L1 exists: a local root must be a directory this user can create or use,
        and that no other server (or adapter) holds; a remote one no other adapter of this
        server may use."""
        field = "path" if config.path is not None else "base_path"
        if config.is_local:
            check_directory(config.local_root, field)
            check_directory_free(config.local_root, field, what=_lock_what(config.local_root))
            temp_dir = _local_temp_dir(config)
            if temp_dir is not None:
                check_directory_free(temp_dir, "relative_tmp_dir", what=_temp_what(temp_dir))
            return
        identity = _remote_identity(config.root)
        if identity is not None:
            check_process_claim_free(identity, field, what=_store_what(config.root))

    def __init__(self, config: FsConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self._capacity = config.capacity_bytes
        self._records: LocalRecords | RemoteRecords
        #: the lock of a local ``relative_tmp_dir``: a store rooted there would sweep this
        #: one's writes in flight, and this one a store's rooted there
        self._temp_lock: DirectoryLock | None = None
        #: what holds the tree: the local directory, or the fsspec records themselves
        self._tree: LocalFiles | RemoteRecords
        #: whether the local root finds names in another letter case (``warn_if_root_folds_case``)
        self._folds_case = False
        if config.is_local:
            self._open_local(config, context)
        else:
            self._open_remote(config, context)
        try:
            self._start_up()
        except BaseException:
            self._release()
            raise

    @property
    def remote(self) -> bool:
        """An fsspec URL's store is reached over a network that may go away: core puts such
        a backend behind its circuit breaker by default (``circuit``), as it does the
        other remote adapters, so that an outage answers misses at once instead of every
        call waiting for the filesystem's timeouts; a local directory is not."""
        return not self.config.is_local

    @property
    def direct_io(self) -> bool:
        """Whether records move with O_DIRECT (``use_odirect`` true, or "auto" where the
        filesystem takes it)."""
        return isinstance(self._records, LocalRecords) and self._records.direct

    def _open_local(self, config: FsConfig, context: BackendContext) -> None:
        root = config.local_root
        try:
            lock = DirectoryLock(root, what=_lock_what(root), durable=config.fsync)
        except OSError as exc:
            raise ConfigError(f"fs: cannot use {root}: {exc.strerror or exc}") from exc
        self._lock: DirectoryLock | ProcessClaim = lock
        try:
            self._temp_lock = _lock_temp_dir(config)
        except BaseException:
            lock.release()
            raise
        layout = FileLayout(lock.root, shard_dirs=config.shard_dirs, temp_dir=config.relative_tmp_dir)
        try:
            if self._temp_lock is not None and layout.temp_dir is not None:
                check_renames_into_root(layout.temp_dir, layout.root)
            files = LocalFiles(
                layout,
                name=context.name,
                count=context.count,
                fsync=config.fsync,
                on_root_recreated=lock.root_recreated,
                removals=context,
            )
            direct = _direct_io(config, layout.root, context.name)
        except BaseException:
            self._release_locks()
            raise
        failures = WriteFailures(context.name, layout.root, context.count)
        self._tree = files
        self._temp_dirs = TempDirRecord(
            _local_filesystem(), layout.root, config.relative_tmp_dir, context, local=True
        )
        self._records = LocalRecords(
            files,
            context,
            direct=direct,
            read_ahead=config.read_ahead_size,
            failures=failures,
        )
        self._folds_case = warn_if_root_folds_case(layout.root, context.name)

    def _open_remote(self, config: FsConfig, context: BackendContext) -> None:
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(config.root, **config.storage_options)
        except (ImportError, ValueError) as exc:
            reason = redact_url_secrets(str(exc))  # it may quote the URL, password and all
            raise ConfigError(f"fs: cannot open {shown(config.root)}: {reason}") from exc
        except OSError as exc:
            # A store that connects as it is opened (ftp, sftp, smb) and does not answer:
            # not a mistake in the config, but the line must say which store it is.
            reason = redact_url_secrets(str(exc))
            raise BackendUnavailableError(f"fs: cannot reach {shown(config.root)}: {reason}") from exc
        # memory:// lives in this process: one adapter per path is the whole rule. Other
        # remote stores cannot be locked from here; give each server its own path.
        self._lock = ProcessClaim(_store_identity(fs.protocol, root), what=_store_what(config.root))
        layout = FileLayout(root, shard_dirs=config.shard_dirs, temp_dir=config.relative_tmp_dir)
        failures = WriteFailures(context.name, redact_url_secrets(config.root), context.count)
        try:
            records = RemoteRecords(fs, layout, context, read_ahead=config.read_ahead_size, failures=failures)
        except BaseException:
            self._lock.release()
            raise
        self._records = self._tree = records
        self._temp_dirs = TempDirRecord(fs, layout.root, config.relative_tmp_dir, context, local=False)

    def _start_up(self) -> None:
        """Remove what a killed run left half-written (in the temporary directories used
        before too), report what it may have left where nothing says it is this root's;
        drop old records if asked to."""
        self._tree.remove_temp_files()
        self._temp_dirs.sweep_and_record()
        record = self._temp_dirs
        if isinstance(self._tree, RemoteRecords):
            listed = self._tree.take_files_elsewhere()
            report_unrecorded_in_listing(record.root, listed, record.current, record.recorded, self.context)
        else:
            report_unrecorded_temp_dirs(record.root, record.current, record.recorded, self.context)
        if not self.config.recover_on_start:
            dropped = self._tree.remove_all_records()
            self.context.count("records_dropped_at_start", dropped)
            log.info(
                "%s: recover_on_start is false: removed %d records of an earlier run",
                self.context.name,
                dropped,
            )

    # -- the backend methods ------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        return self._records.write_many(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return [self._records.stored_size(key) for key in keys]

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Sequence[int | ObjectSize | None] | None:
        """Misses told from memory: the local directory is this process's alone (its
        ``DirectoryLock``), so once core's start-up scan listed it, a key core does not
        account is not on disk.  A batch with any accounted key -- or a remote root,
        which other writers may share -- goes to ``contains_many``: the record file is
        what says whether a hit is still there."""
        return self.context.misses_now(keys) if self.config.is_local else None

    @property
    def answers_lookups_now(self) -> bool:
        """Whether ``contains_many_now`` ever answers: only on a local directory."""
        return self.config.is_local

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return self._records.read_many(keys, buffers)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        return [self._tree.delete(key) for key in keys]

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        return self._tree.iter_records(self._records.sizes.length)

    def capacity(self) -> int | None:
        return self._capacity

    def stats(self) -> dict[str, int]:
        """``case_insensitive_root`` (local roots): 1 when the root's filesystem folds
        letter case in names, so keys that differ only in case replace each other's
        records -- a flag in ``/status`` and ``/metrics`` next to the start-up line."""
        return {"case_insensitive_root": int(self._folds_case)} if self.config.is_local else {}

    def close(self) -> None:
        try:
            if not self.config.persist_enabled:
                removed = self._tree.remove_all_records()
                log.info("%s: persistence off, removed %d record files", self.context.name, removed)
        finally:
            self._release()

    def _release(self) -> None:
        self._records.close()
        self._release_locks()

    def _release_locks(self) -> None:
        if self._temp_lock is not None:
            self._temp_lock.release()
        self._lock.release()


def _lock_temp_dir(config: FsConfig) -> DirectoryLock | None:
    """Lock a local ``relative_tmp_dir`` as a root is locked (created if missing)."""
    temp_dir = _local_temp_dir(config)
    if temp_dir is None:
        return None
    try:
        return DirectoryLock(temp_dir, what=_temp_what(temp_dir), durable=config.fsync)
    except OSError as exc:
        raise ConfigError(f"fs: cannot use {temp_dir}: {exc.strerror or exc}") from exc


def _local_filesystem() -> object:
    """fsspec's filesystem of local paths: the record of temporary directories is read and
    written through it, the same calls for a local root as for a remote one."""
    import fsspec

    return fsspec.filesystem("file")


def _direct_io(config: FsConfig, directory: str, name: str) -> bool:
    """Whether records in ``directory`` move with O_DIRECT: ``use_odirect`` true refuses at
    start-up a filesystem that does not take it (ramfs, tmpfs before Linux 6.6); "auto" uses
    the page cache there."""
    if config.use_odirect is False:
        return False
    refusal = direct_io_refusal(directory)
    if refusal is None:
        return True
    if config.use_odirect is True:
        raise ConfigError(
            f"fs: use_odirect is true but the filesystem of {directory} refuses O_DIRECT ({refusal}); "
            'set use_odirect to false or "auto"'
        )
    log.info(
        "%s: the filesystem of %s refuses O_DIRECT (%s): records go through the page cache",
        name,
        directory,
        refusal,
    )
    return False
