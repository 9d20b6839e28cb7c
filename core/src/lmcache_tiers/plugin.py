"""The public API of lmcache-tiers for plugin authors.

A plugin imports from here and nowhere else in ``lmcache_tiers``: these names are what the
project keeps stable for third-party packages.  Importing this module is cheap (no numpy,
no pytest): manifests import it whenever plugins are listed.  Names whose modules are
heavier -- the backend context, record and copy helpers, the conformance suites -- are
imported on first use.

What each kind of plugin needs:

* every plugin: ``hookimpl``, ``KindRegistry``, ``ComponentConfig`` (config base Struct,
  keyword-only, frozen and strict for every subclass), ``EmptyConfig``, the errors,
  ``FieldError`` (a ``__post_init__`` error naming the field at fault), ``SizeGiB`` (a
  size in GiB, at most ``MAX_GIB``: ``Annotated[SizeGiB, msgspec.Meta(gt=0.0)]``) and
  ``check_size_gib`` (a positive size under one byte refused in ``__post_init__``);
* an L2 backend: ``L2Backend`` / ``AsyncL2Backend`` (protocols), ``L2AdapterConfig``,
  ``BackendContext``, ``ObjectKey``, ``ObjectSize``, ``Capacity``; remote ones
  ``CircuitConfig`` (the ``circuit`` option) and ``PROBE_KEY`` (what a probe asks about); persistent ones also
  ``RecordError`` (and subclasses), ``RecordVerdict`` / ``record_verdict`` (the one rule for
  a record read back that cannot serve its key: ``BackendContext.kept_record`` applies it;
  ``KeptByDelete`` for deletes that read headers, ``DeleteMarks`` for other marks a delete
  leaves for the next lookup), ``RecordHeader``, ``verify_payload`` (``PayloadVerifier``
  for payloads read in pieces), loads verified as the bytes move ``read_record_file``,
  ``copy_verified`` (and ``copy_and_checksum`` for stores, ``VERIFY_PIECE``),
  ``header_length``, ``PREFIX_SIZE``, ``HEADER_CRC_SIZE``; backends copying bytes
  ``copy_into``, and moving a batch's objects on a few threads ``BatchWorkers``; store
  work: a long copy or checksum that releases the GIL inside ``with
  WRITE_BACK.copying():`` (idle-class while write-back keeps up), a thread of the
  backend's own joining the write-back threads with
  ``WRITE_BACK.enter()``; slot and extent stores
  ``ExtentAllocator``, and reader counts per slot ``SlotReaders``; a warning logged once
  per burst ``BurstLog``;
* policies: ``StorePolicy``, ``PrefetchPolicy``, ``EvictionPolicy``, ``AdapterInfo``,
  ``LowestIndexPrefetchPolicy``, ``plan_from_lowest_index``; eviction policies with
  ``set_aside``/``put_back``: ``StampedKeys`` (keys put back, waiting in stamp order);
* a serde: ``Serde``, ``SerdeContext``, ``TensorLayout`` (and ``MAX_LAYOUT_LEN``, the longest
  layout a record states);
* a front end: ``Frontend``, ``FrontendConfig``, ``FrontendContext``, ``FrontendStats``,
  ``ServerConfig``, ``StorageManager`` (what it serves), ``RouterLoop`` (a ZeroMQ ROUTER
  loop), the process at the far end of a connection ``watch_peer`` / ``PeerProcess`` and
  a pidfd's exit ``pidfd_exited``, whether a process maps the arena ``maps_file`` /
  ``watch_writer_socket``, each
  connection's process looked up once, off the request loop, ``ConnectionPeers`` /
  ``PeerWatch`` (a ``PeerScanner`` finds it),
  ``L1Loan``, ``is_loopback``, the key helpers ``NONE_HASH``, ``chunk_hashes``,
  ``kv_rank_of``, ``L1OutOfMemoryError``; the native protocol's Structs
  ``wire_protocol``, ``segment_identity`` and ``SHM_DIR`` (shared with the Python client), and
  ``decode_request`` with its ``KeyCache`` (a server's decoding of request headers);
* file-per-object stores: ``FileLayout``, ``LocalFiles``, ``DirectoryLock`` (and
  ``PathLock``, ``DirectoryInUseError``), ``HeaderSizes``, ``WriteFailures``,
  ``RemovalFailures`` (a sweep removing every record), ``DeleteFailures`` (deletes that
  failed, counted and told once per burst),
  ``RECORD_ALIGN``, ``RECORD_SUFFIX``, whole verified loads of record files
  ``RecordLoads``, name helpers (``record_name``, ``classify_name``,
  ``EntryKind``, ``is_temp_name``, ``check_relative_dir``, ``record_key``), ``identity_of``,
  ``FileIdentity``, ``is_out_of_space``, ``fsync_directory`` (a directory's entries made
  durable), ``ABSENT_FILE_ERRORS`` (the errors that mean "no
  such record"), ``KeyStripes`` (per-key locks), ``judge_digest_record``,
  ``keeps_unlisted`` and ``log_unreadable_header`` (listing digest-named records), a root
  whose filesystem folds letter case told at start-up ``warn_if_root_folds_case``; stores
  with paths or devices, for their ``preflight``: ``check_directory``, ``check_file``, a directory
  another server holds ``check_directory_free``, a device named by two adapters ``check_claimed_once``,
  a store living in the process (``memory://``) ``check_process_claim_free``;
  whether a directory takes
  ``O_DIRECT``: ``direct_io_refusal``;
* tests: ``L2AdapterSuite`` (``PERSISTENCE``, ``CAPACITY``, ``EVICTION``, ``IMMEDIATE_MISSES``,
  ``IMMEDIATE_HITS``, ``BACKEND_FAILURES``, ``DETECTS_DAMAGE``; ``DeflateSerde`` runs it on frames that change
  size; ``ScratchDirectory`` gives each test a fresh ``self.storage_dir`` for
  ``make_config``), ``SerdeSuite``
  (``LOSSLESS``, ``DETECTS_CORRUPTION``, ``BINDS_KEY``),
  ``StorePolicySuite``, ``PrefetchPolicySuite``, ``EvictionPolicySuite`` (``EVICTS``,
  ``RECENCY``, ``LOADS_EVERY_HIT``, ``STORES_EVERYWHERE``), ``ComponentSuite``,
  ``FrontendSuite`` (with a ``FrontendDriver`` speaking the front end's protocol),
  ``BlockingAdapterClient``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lmcache_tiers import __version__
from lmcache_tiers.config import (
    MAX_GIB,
    CircuitConfig,
    ComponentConfig,
    FieldError,
    FrontendConfig,
    L2AdapterConfig,
    L2EvictionConfig,
    ServerConfig,
    SizeGiB,
    check_size_gib,
    redact_url_secrets,
)
from lmcache_tiers.endpoints import is_loopback
from lmcache_tiers.errors import (
    BackendUnavailableError,
    ConfigError,
    KeyValidationError,
    L1OutOfMemoryError,
    PartialFailure,
    TiersError,
)
from lmcache_tiers.frontend import Frontend, FrontendContext, FrontendStats
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keycodec import is_digest_name, key_to_name, name_to_key, printable
from lmcache_tiers.keys import NONE_HASH, ObjectKey, chunk_hashes, kv_rank_of
from lmcache_tiers.policies import LowestIndexPrefetchPolicy, plan_from_lowest_index
from lmcache_tiers.protocols import (
    AdapterInfo,
    AsyncL2Backend,
    Capacity,
    EvictionPolicy,
    ImmediateLookups,
    L2Backend,
    ObjectSize,
    PrefetchPolicy,
    Serde,
    StorePolicy,
)
from lmcache_tiers.registry import EmptyConfig, Kind, KindRegistry
from lmcache_tiers.stamped_keys import StampedKeys

if TYPE_CHECKING:
    from lmcache_tiers.burst import BurstLog
    from lmcache_tiers.l1.allocator import ExtentAllocator
    from lmcache_tiers.l1.loan import L1Loan
    from lmcache_tiers.l2.background import WRITE_BACK
    from lmcache_tiers.l2.buffers import GIL_FREE_COPY_BYTES, copy_into
    from lmcache_tiers.l2.calls import is_async_backend
    from lmcache_tiers.l2.circuit import PROBE_KEY
    from lmcache_tiers.l2.context import BackendContext, KeptByDelete
    from lmcache_tiers.l2.files import (
        ABSENT_FILE_ERRORS,
        RECORD_ALIGN,
        RECORD_SUFFIX,
        DeleteFailures,
        DirectoryInUseError,
        DirectoryLock,
        EntryKind,
        FileIdentity,
        FileLayout,
        HeaderSizes,
        KeyStripes,
        LocalFiles,
        PathLock,
        ProcessClaim,
        RemovalFailures,
        WriteFailures,
        check_relative_dir,
        classify_name,
        identity_of,
        is_out_of_space,
        is_temp_name,
        judge_digest_record,
        keeps_unlisted,
        log_unreadable_header,
        record_key,
        record_name,
        warn_if_root_folds_case,
    )
    from lmcache_tiers.l2.files.durable import fsync_directory
    from lmcache_tiers.l2.files.loads import RecordLoads
    from lmcache_tiers.l2.interface import L2Adapter, L2Listener, L2Op, LookupResult
    from lmcache_tiers.l2.leftcalls import LeftCallThreads
    from lmcache_tiers.l2.marks import DeleteMarks
    from lmcache_tiers.l2.preflight import (
        check_claimed_once,
        check_directory,
        check_directory_free,
        check_file,
        check_process_claim_free,
        direct_io_refusal,
    )
    from lmcache_tiers.l2.readers import SlotReaders
    from lmcache_tiers.l2.record import (
        HEADER_CRC_SIZE,
        PREFIX_SIZE,
        PayloadVerifier,
        RecordChecksumError,
        RecordCorruptError,
        RecordError,
        RecordHeader,
        RecordMismatchError,
        RecordSerdeMismatchError,
        RecordVerdict,
        RecordVersionError,
        header_length,
        record_verdict,
        verify_payload,
    )
    from lmcache_tiers.l2.verified import VERIFY_PIECE, copy_and_checksum, copy_verified, read_record_file
    from lmcache_tiers.l2.workers import BatchWorkers
    from lmcache_tiers.layout import MAX_LAYOUT_LEN, TensorLayout
    from lmcache_tiers.peer_process import (
        PeerProcess,
        PeerSocket,
        maps_file,
        peer_socket,
        pidfd_exited,
        watch_peer,
        watch_peer_socket,
        watch_writer_socket,
    )
    from lmcache_tiers.peer_scan import ConnectionPeers, PeerScanner, PeerWatch
    from lmcache_tiers.router import RouterLoop
    from lmcache_tiers.serde import SerdeContext
    from lmcache_tiers.storage import StorageManager
    from lmcache_tiers.testing.base import ComponentSuite
    from lmcache_tiers.testing.blocking import BlockingAdapterClient
    from lmcache_tiers.testing.files import ScratchDirectory
    from lmcache_tiers.testing.frontend import FrontendDriver, FrontendSuite
    from lmcache_tiers.testing.l2 import (
        BACKEND_FAILURES,
        CAPACITY,
        DETECTS_DAMAGE,
        EVICTION,
        IMMEDIATE_HITS,
        IMMEDIATE_MISSES,
        PERSISTENCE,
        DeflateSerde,
        L2AdapterSuite,
    )
    from lmcache_tiers.testing.policies import (
        EVICTS,
        LOADS_EVERY_HIT,
        RECENCY,
        STORES_EVERYWHERE,
        EvictionPolicySuite,
        PrefetchPolicySuite,
        StorePolicySuite,
    )
    from lmcache_tiers.testing.ports import free_port, free_ports
    from lmcache_tiers.testing.serde import BINDS_KEY, DETECTS_CORRUPTION, LOSSLESS, SerdeSuite
    from lmcache_tiers.tmpfs import SHM_DIR
    from lmcache_tiers.wire import protocol as wire_protocol
    from lmcache_tiers.wire.decoding import KeyCache, decode_request
    from lmcache_tiers.wire.shm import segment_identity

#: modules exported whole (the native protocol's Structs, shared with the client)
_LAZY_MODULES = {"wire_protocol": "lmcache_tiers.wire.protocol"}
_RECORD = "lmcache_tiers.l2.record"
_VERIFIED = "lmcache_tiers.l2.verified"
_FILES = "lmcache_tiers.l2.files"
_L2 = "lmcache_tiers.l2.interface"
_POLICY_SUITES = "lmcache_tiers.testing.policies"
_LAZY = {
    "BackendContext": "lmcache_tiers.l2.context",
    "KeptByDelete": "lmcache_tiers.l2.context",
    "DeleteMarks": "lmcache_tiers.l2.marks",
    "SlotReaders": "lmcache_tiers.l2.readers",
    "BatchWorkers": "lmcache_tiers.l2.workers",
    "WRITE_BACK": "lmcache_tiers.l2.background",
    "BurstLog": "lmcache_tiers.burst",
    "copy_into": "lmcache_tiers.l2.buffers",
    "PROBE_KEY": "lmcache_tiers.l2.circuit",
    "GIL_FREE_COPY_BYTES": "lmcache_tiers.l2.buffers",
    "ExtentAllocator": "lmcache_tiers.l1.allocator",
    "SerdeContext": "lmcache_tiers.serde",
    "TensorLayout": "lmcache_tiers.layout",
    "MAX_LAYOUT_LEN": "lmcache_tiers.layout",
    "ABSENT_FILE_ERRORS": _FILES,
    "RECORD_ALIGN": _FILES,
    "RECORD_SUFFIX": _FILES,
    "DeleteFailures": _FILES,
    "DirectoryInUseError": _FILES,
    "DirectoryLock": _FILES,
    "EntryKind": _FILES,
    "FileIdentity": _FILES,
    "FileLayout": _FILES,
    "HeaderSizes": _FILES,
    "RemovalFailures": _FILES,
    "KeyStripes": _FILES,
    "LocalFiles": _FILES,
    "PathLock": _FILES,
    "ProcessClaim": _FILES,
    "WriteFailures": _FILES,
    "check_relative_dir": _FILES,
    "classify_name": _FILES,
    "identity_of": _FILES,
    "is_out_of_space": _FILES,
    "is_temp_name": _FILES,
    "judge_digest_record": _FILES,
    "keeps_unlisted": _FILES,
    "log_unreadable_header": _FILES,
    "record_key": _FILES,
    "record_name": _FILES,
    "warn_if_root_folds_case": _FILES,
    "RecordLoads": "lmcache_tiers.l2.files.loads",
    "fsync_directory": "lmcache_tiers.l2.files.durable",
    "check_claimed_once": "lmcache_tiers.l2.preflight",
    "check_directory": "lmcache_tiers.l2.preflight",
    "check_directory_free": "lmcache_tiers.l2.preflight",
    "check_process_claim_free": "lmcache_tiers.l2.preflight",
    "check_file": "lmcache_tiers.l2.preflight",
    "direct_io_refusal": "lmcache_tiers.l2.preflight",
    "LeftCallThreads": "lmcache_tiers.l2.leftcalls",
    "is_async_backend": "lmcache_tiers.l2.calls",
    "L2Adapter": _L2,
    "L2Listener": _L2,
    "L2Op": _L2,
    "LookupResult": _L2,
    "PREFIX_SIZE": _RECORD,
    "HEADER_CRC_SIZE": _RECORD,
    "PayloadVerifier": _RECORD,
    "RecordChecksumError": _RECORD,
    "RecordCorruptError": _RECORD,
    "RecordError": _RECORD,
    "RecordHeader": _RECORD,
    "RecordMismatchError": _RECORD,
    "RecordSerdeMismatchError": _RECORD,
    "RecordVersionError": _RECORD,
    "RecordVerdict": _RECORD,
    "record_verdict": _RECORD,
    "header_length": _RECORD,
    "verify_payload": _RECORD,
    "VERIFY_PIECE": _VERIFIED,
    "copy_and_checksum": _VERIFIED,
    "copy_verified": _VERIFIED,
    "read_record_file": _VERIFIED,
    "BlockingAdapterClient": "lmcache_tiers.testing.blocking",
    "FrontendDriver": "lmcache_tiers.testing.frontend",
    "FrontendSuite": "lmcache_tiers.testing.frontend",
    "L1Loan": "lmcache_tiers.l1.loan",
    "RouterLoop": "lmcache_tiers.router",
    "PeerProcess": "lmcache_tiers.peer_process",
    "watch_peer": "lmcache_tiers.peer_process",
    "PeerSocket": "lmcache_tiers.peer_process",
    "maps_file": "lmcache_tiers.peer_process",
    "peer_socket": "lmcache_tiers.peer_process",
    "watch_peer_socket": "lmcache_tiers.peer_process",
    "watch_writer_socket": "lmcache_tiers.peer_process",
    "pidfd_exited": "lmcache_tiers.peer_process",
    "ConnectionPeers": "lmcache_tiers.peer_scan",
    "PeerScanner": "lmcache_tiers.peer_scan",
    "PeerWatch": "lmcache_tiers.peer_scan",
    "StorageManager": "lmcache_tiers.storage",
    "segment_identity": "lmcache_tiers.wire.shm",
    "SHM_DIR": "lmcache_tiers.tmpfs",
    "KeyCache": "lmcache_tiers.wire.decoding",
    "decode_request": "lmcache_tiers.wire.decoding",
    "ComponentSuite": "lmcache_tiers.testing.base",
    "L2AdapterSuite": "lmcache_tiers.testing.l2",
    "DeflateSerde": "lmcache_tiers.testing.l2",
    "ScratchDirectory": "lmcache_tiers.testing.files",
    "PERSISTENCE": "lmcache_tiers.testing.l2",
    "BACKEND_FAILURES": "lmcache_tiers.testing.l2",
    "CAPACITY": "lmcache_tiers.testing.l2",
    "DETECTS_DAMAGE": "lmcache_tiers.testing.l2",
    "IMMEDIATE_HITS": "lmcache_tiers.testing.l2",
    "IMMEDIATE_MISSES": "lmcache_tiers.testing.l2",
    "EVICTION": "lmcache_tiers.testing.l2",
    "StorePolicySuite": _POLICY_SUITES,
    "PrefetchPolicySuite": _POLICY_SUITES,
    "EvictionPolicySuite": _POLICY_SUITES,
    "EVICTS": _POLICY_SUITES,
    "RECENCY": _POLICY_SUITES,
    "LOADS_EVERY_HIT": _POLICY_SUITES,
    "STORES_EVERYWHERE": _POLICY_SUITES,
    "SerdeSuite": "lmcache_tiers.testing.serde",
    "LOSSLESS": "lmcache_tiers.testing.serde",
    "DETECTS_CORRUPTION": "lmcache_tiers.testing.serde",
    "BINDS_KEY": "lmcache_tiers.testing.serde",
    "free_port": "lmcache_tiers.testing.ports",
    "free_ports": "lmcache_tiers.testing.ports",
}

__all__ = [
    "ABSENT_FILE_ERRORS",
    "BACKEND_FAILURES",
    "BINDS_KEY",
    "CAPACITY",
    "DETECTS_CORRUPTION",
    "DETECTS_DAMAGE",
    "EVICTION",
    "EVICTS",
    "GIL_FREE_COPY_BYTES",
    "HEADER_CRC_SIZE",
    "IMMEDIATE_HITS",
    "IMMEDIATE_MISSES",
    "LOADS_EVERY_HIT",
    "LOSSLESS",
    "MAX_GIB",
    "MAX_LAYOUT_LEN",
    "NONE_HASH",
    "PERSISTENCE",
    "PREFIX_SIZE",
    "PROBE_KEY",
    "RECENCY",
    "RECORD_ALIGN",
    "RECORD_SUFFIX",
    "SHM_DIR",
    "STORES_EVERYWHERE",
    "VERIFY_PIECE",
    "WRITE_BACK",
    "AdapterInfo",
    "AsyncL2Backend",
    "BackendContext",
    "BackendUnavailableError",
    "BatchWorkers",
    "BlockingAdapterClient",
    "BurstLog",
    "Capacity",
    "CircuitConfig",
    "ComponentConfig",
    "ComponentSuite",
    "ConfigError",
    "ConnectionPeers",
    "DeflateSerde",
    "DeleteFailures",
    "DeleteMarks",
    "DirectoryInUseError",
    "DirectoryLock",
    "EmptyConfig",
    "EntryKind",
    "EvictionPolicy",
    "EvictionPolicySuite",
    "ExtentAllocator",
    "FieldError",
    "FileIdentity",
    "FileLayout",
    "Frontend",
    "FrontendConfig",
    "FrontendContext",
    "FrontendDriver",
    "FrontendStats",
    "FrontendSuite",
    "HeaderSizes",
    "ImmediateLookups",
    "KeptByDelete",
    "KeyCache",
    "KeyStripes",
    "KeyValidationError",
    "Kind",
    "KindRegistry",
    "L1Loan",
    "L1OutOfMemoryError",
    "L2Adapter",
    "L2AdapterConfig",
    "L2AdapterSuite",
    "L2Backend",
    "L2EvictionConfig",
    "L2Listener",
    "L2Op",
    "LeftCallThreads",
    "LocalFiles",
    "LookupResult",
    "LowestIndexPrefetchPolicy",
    "ObjectKey",
    "ObjectSize",
    "PartialFailure",
    "PathLock",
    "PayloadVerifier",
    "PeerProcess",
    "PeerScanner",
    "PeerSocket",
    "PeerWatch",
    "PrefetchPolicy",
    "PrefetchPolicySuite",
    "ProcessClaim",
    "RecordChecksumError",
    "RecordCorruptError",
    "RecordError",
    "RecordHeader",
    "RecordLoads",
    "RecordMismatchError",
    "RecordSerdeMismatchError",
    "RecordVerdict",
    "RecordVersionError",
    "RemovalFailures",
    "RouterLoop",
    "ScratchDirectory",
    "Serde",
    "SerdeContext",
    "SerdeSuite",
    "ServerConfig",
    "SizeGiB",
    "SlotReaders",
    "StampedKeys",
    "StorageManager",
    "StorePolicy",
    "StorePolicySuite",
    "TensorLayout",
    "TiersError",
    "WriteFailures",
    "__version__",
    "check_claimed_once",
    "check_directory",
    "check_directory_free",
    "check_file",
    "check_process_claim_free",
    "check_relative_dir",
    "check_size_gib",
    "chunk_hashes",
    "classify_name",
    "copy_and_checksum",
    "copy_into",
    "copy_verified",
    "decode_request",
    "direct_io_refusal",
    "free_port",
    "free_ports",
    "fsync_directory",
    "header_length",
    "hookimpl",
    "identity_of",
    "is_async_backend",
    "is_digest_name",
    "is_loopback",
    "is_out_of_space",
    "is_temp_name",
    "judge_digest_record",
    "keeps_unlisted",
    "key_to_name",
    "kv_rank_of",
    "log_unreadable_header",
    "maps_file",
    "name_to_key",
    "peer_socket",
    "pidfd_exited",
    "plan_from_lowest_index",
    "printable",
    "read_record_file",
    "record_key",
    "record_name",
    "record_verdict",
    "redact_url_secrets",
    "segment_identity",
    "verify_payload",
    "warn_if_root_folds_case",
    "watch_peer",
    "watch_peer_socket",
    "watch_writer_socket",
    "wire_protocol",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        globals()[name] = importlib.import_module(_LAZY_MODULES[name])
        return globals()[name]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
