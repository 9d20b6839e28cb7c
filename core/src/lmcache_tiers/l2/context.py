"""What an adapter is built from: the facts the StorageManager knows (``AdapterContext``)
and what a backend's factory receives from core (``BackendContext``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keycodec import printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files.layout import record_name
from lmcache_tiers.l2.record import (
    RecordError,
    RecordHeader,
    RecordL1SizeError,
    RecordSerdeMismatchError,
    RecordVerdict,
    decode_header,
    encode_header,
    record_verdict,
)
from lmcache_tiers.protocols import ObjectSize, Serde

if TYPE_CHECKING:
    from lmcache_tiers.l2.state import AdapterState


def buffer_address(buffer: memoryview) -> int:
    """Virtual address of a buffer's first byte (read-only buffers too)."""
    # numpy reads the address through the buffer protocol without copying and, unlike
    # ctypes.from_buffer, accepts read-only views.
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True)
class AdapterContext:
    """Runtime facts about one configured adapter, built by the StorageManager."""

    #: position of the adapter in the configured cascade (0 first)
    index: int
    #: instance label, e.g. ``"0:mock"``; used in logs, metrics and thread names
    name: str
    #: the adapter's decoded config (the same object the factory gets first)
    config: L2AdapterConfig
    #: serde chain in encoding order; the adapter applies it
    serde: Sequence[Serde] = field(default_factory=tuple)
    #: the whole L1 arena, for backends that register memory once (NIXL); None in tests
    #: that run an adapter without an L1
    l1_buffer: memoryview | None = None
    #: True when ``l1_buffer`` is ordinary host memory (DRAM) that may be registered as
    #: such; False if it is device memory or of unknown kind
    l1_is_memory: bool = True
    #: L1's capacity in bytes: no object of this adapter can be larger in L1, so a record
    #: claiming more is damaged (None in tests that run an adapter without an L1)
    l1_capacity: int | None = None

    def l1_offset(self, buffer: memoryview) -> int | None:
        """Offset of ``buffer`` inside the L1 arena, or None if it lies (partly) outside."""
        if self.l1_buffer is None or buffer.nbytes == 0:
            return None
        offset = buffer_address(buffer) - buffer_address(self.l1_buffer)
        if offset >= 0 and offset + buffer.nbytes <= self.l1_buffer.nbytes:
            return offset
        return None


class BackendContext:
    """What core gives a backend: the second argument of every L2 adapter factory.

    A backend needs at most: ``name`` and ``config``; ``l1_buffer`` (host memory of the
    L1 arena to register once, or None); ``count`` (counters in ``stats()``); the record
    helpers ``record_header`` / ``read_record_header`` (``peek_record_header`` for a
    start-up scan) / ``l1_size_of``; ``closing`` and
    ``sleep``; ``reading_records`` around a listing's header reads.  Wrappers build the
    backend they wrap with ``open_inner``, and note a lookup they may leave running with
    ``reading_records``.  ``index``,
    ``serde``, ``l1_offset`` and ``facts`` are for factories that return a complete
    :class:`~lmcache_tiers.l2.interface.L2Adapter`.
    """

    def __init__(
        self,
        state: AdapterState,
        *,
        name: str | None = None,
        config: L2AdapterConfig | None = None,
        counter_prefix: str = "",
    ) -> None:
        self._state = state
        self._prefix = counter_prefix
        self.facts: AdapterContext = state.facts
        #: label for logs, e.g. ``"0:nixl_store"`` (``"0:fault_inject>mock"`` when wrapped)
        self.name = name or state.facts.name
        #: the backend's own decoded config Struct
        self.config = config if config is not None else state.facts.config
        self.index = state.facts.index
        #: the L1 arena when it is host memory a backend may register once, else None
        self.l1_buffer = state.facts.l1_buffer if state.facts.l1_is_memory else None

    @property
    def serde(self) -> tuple[Serde, ...]:
        """The adapter's serde chain in encoding order (core applies it to backends)."""
        return self._state.chain.serdes

    def l1_offset(self, buffer: memoryview) -> int | None:
        """Offset of ``buffer`` in the L1 arena, None when it is not a slice of it."""
        return self.facts.l1_offset(buffer)

    # -- for every backend ---------------------------------------------------------------------

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a counter reported by the adapter's ``stats()`` (and ``/metrics``)."""
        self._state.count(self._prefix + name, amount)

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning about this adapter at most once a minute per ``kind`` (the
        ones held back are counted in the next line), so a failing store explains itself
        without flooding the log.  ``message`` is a %-format; the adapter name is added."""
        self._state.burst.warn(f"{self._prefix}{kind}", "%s: " + message, self.name, *args)

    def accounted_size(self, key: ObjectKey) -> ObjectSize | None:
        """What this adapter accounts for ``key`` now (None: nothing).  Read it before
        removing a damaged record of ``key``, for :meth:`record_removed`."""
        return self._state.accounting.get(key)

    def record_removed(self, key: ObjectKey, accounted: ObjectSize | None) -> None:
        """This backend has just removed ``key``'s damaged record (and counted it, e.g.
        ``corrupt_records_removed``): its bytes are released and it is announced as
        deleted, so that the usage and the eviction policy follow now -- not when a later
        lookup finds it gone and takes it for a removal behind this adapter's back.
        ``accounted`` is :meth:`accounted_size` from before the removal: a store of the key
        that settled since keeps its own entry (and its record)."""
        state = self._state
        if accounted is not None and state.accounting.forget_if(key, accounted):
            state.forget_unreadable([key])
            state.notify("on_l2_keys_deleted", [key])

    def kept_record(self, key: ObjectKey, error: RecordError, *, counted: bool = False) -> bool:
        """Judge a record of ``key`` whose reading raised ``error`` (:func:`record_verdict`,
        the one rule every header read follows).  True: it is intact but not this server's
        to read -- another key's (:meth:`foreign_record`) or of a newer format
        (:meth:`unknown_version`): report a miss and keep it; it is counted and logged
        here unless ``counted`` (a delete did already, :class:`KeptByDelete`).  False: it
        is damaged -- report a miss, remove it (only if it is still the record judged) and
        count ``corrupt_records_removed``."""
        verdict = record_verdict(error)
        if verdict.kept and not counted:
            self._kept_miss(verdict, key, error)
        return verdict.kept

    def foreign_record(self, key: ObjectKey, error: Exception) -> None:
        """Count and explain an intact record of another key found under ``key``'s name.

        No damage makes one (the header's crc covers the key): another writer does -- a
        server whose key prefix extends this one's, another adapter type sharing the
        folder, keys that differ only in case on a case-insensitive filesystem.  It is
        that writer's acknowledged object: the caller reports a miss and keeps it."""
        self._kept_miss(RecordVerdict.FOREIGN, key, error)

    def unknown_version(self, key: ObjectKey, error: Exception) -> None:
        """Count and explain a record of a format version this code does not read under
        ``key``'s name: written by a newer server sharing the store, which reads it -- the
        caller reports a miss and keeps it."""
        self._kept_miss(RecordVerdict.NEWER, key, error)

    def unknown_version_indexed(self, key: ObjectKey, error: Exception) -> bool:
        """:meth:`unknown_version` for a backend answering lookups from an index in memory
        (the slot stores), where every lookup of the key would find it and every load of
        it fail: the key is also a miss until replaced, as a record of another serde
        chain is -- lookups answer it absent without asking the backend, loads skip it,
        it stays accounted (the L2 eviction deletes it), and a store or delete of the key
        ends that.  False when not marked: a store of the key ran meanwhile (its new
        record is judged when next read)."""
        # Kept accounted: the slot is this adapter's to reclaim (its eviction deletes it).
        self._kept_miss(RecordVerdict.NEWER, key, error, release=False)
        return self._state.mark_undecodable(key)  # the same mark: unreadable until replaced

    def _kept_miss(
        self, verdict: RecordVerdict, key: ObjectKey, error: Exception, *, release: bool = True
    ) -> None:
        self.count(verdict.counter)
        self.warn(verdict.counter, "%s: %s; a miss, kept", printable(key.file_stem()), error)
        if release:
            self._state.release_replaced(key)

    @contextmanager
    def reading_records(self, keys: Sequence[ObjectKey]) -> Iterator[None]:
        """Note ``keys``' records as being read while the block runs: for a read no lookup
        or load op notes -- a start-up listing that judges headers with
        ``read_record_header`` -- and for a lookup a wrapper runs on a helper thread and
        may give up before it returns (a timeout: the lookup op ends its own note then,
        and the call left running may still judge what it read).  Begin it before the
        records are read.  A store of a key landing meanwhile must count as one that may
        have replaced that record -- else an old record of another key releases the
        store's entry, one of another serde chain marks the key a miss over it."""
        self._state.reading_begin(keys)
        try:
            yield
        finally:
            self._state.reading_end(keys)

    @property
    def closing(self) -> bool:
        """True once the adapter started closing: long calls should return early."""
        return self._state.closing.is_set()

    def sleep(self, seconds: float) -> bool:
        """Sleep (simulated latency, back-off); False if closing cut it short."""
        closing = self._state.closing
        return not closing.wait(seconds) if seconds > 0 else not closing.is_set()

    # -- for persistent backends ---------------------------------------------------------------

    def misses_now(self, keys: Sequence[ObjectKey]) -> list[None] | None:
        """A ``contains_many_now`` answer of all misses when core accounts none of ``keys``
        for this adapter (neither stored through it nor listed by its start-up scan) and
        the scan has listed the whole store; None otherwise (a key is accounted, the scan
        runs, or it stopped early).

        For a backend whose store nobody else writes (a directory under
        ``DirectoryLock``): a key not accounted then is not stored.  A hit is left to
        ``contains_many``, where the record says whether it is still there.  Memory only.
        """
        accounting = self._state.accounting
        if not accounting.complete or any(size is not None for size in accounting.get_many(keys)):
            return None
        return [None] * len(keys)

    def l1_size_of(self, key: ObjectKey) -> int | None:
        """The L1 size of ``key`` (being stored now, or known to core); None if unknown.

        When it is None, ``contains_many`` should report ``ObjectSize`` from the record
        header: the serde chain may change sizes and core cannot tell the L1 size.
        """
        return self._state.l1_size_of(key)

    def record_header(
        self, key: ObjectKey, payload: memoryview, *, align: int = 1, digest: bytes | None = None
    ) -> bytes:
        """The record header of a payload ``put_many`` got: L1 size, layout and serde
        chain of the key being stored are filled in; ``align`` pads it to a multiple;
        ``digest`` is the payload's checksum when the backend took it already (while
        copying it: :func:`~lmcache_tiers.l2.verified.copy_and_checksum`)."""
        storing = self._state.storing(key, memoryview(payload).nbytes)
        l1_size, layout = storing if storing is not None else (self._state.l1_size_of(key), "")
        return encode_header(
            key,
            payload,
            l1_size=payload.nbytes if l1_size is None else l1_size,
            serde=self._state.chain.names,
            layout=layout,
            align=align,
            digest=digest,
        )

    def header_too_long(self, key: ObjectKey, length: int, reserved: int) -> None:
        """The record header of ``key`` came out ``length`` bytes where the backend reserved
        ``reserved`` for it: counted (``record_header_too_long``) and logged; the backend
        then reports that store failed."""
        self.count("record_header_too_long")
        self.warn(
            "record_header_too_long",
            "the record header of %s came out %d bytes, not the %d reserved: not stored",
            printable(record_name(key)),
            length,
            reserved,
        )

    def read_record_header(
        self, data: bytes | memoryview, key: ObjectKey, *, l1_size_counted: bool = False
    ) -> RecordHeader | None:
        """Decode and verify a stored header of ``key``.

        None: the record is intact but written with another serde chain -- report a miss
        and keep it (it is counted as ``serde_chain_mismatch``; restoring that chain makes
        it readable again).  Raises a :class:`~lmcache_tiers.l2.record.RecordError`
        otherwise: hand it to :meth:`kept_record`, which says whether the record is kept
        (another key's intact record, a newer format's: counted there) or damaged (report
        a miss, remove it and ``count("corrupt_records_removed")``).

        ``l1_size_counted``: a read of this record just counted its impossible L1 size
        (:class:`~lmcache_tiers.l2.record.RecordL1SizeError`), and this one judges it again.
        """
        try:
            header = decode_header(data, expected_key=key, expected_serde=self._state.chain.names)
        except RecordSerdeMismatchError:
            written = decode_header(data, expected_key=key).serde
            self._state.mark_unreadable(key, written)
            return None
        self._check_l1_size(key, header, counted=l1_size_counted)
        # The loads of the key in their backend call carry it in their results (LoadResult).
        self._state.note_layout(key, header.layout)
        return header

    @property
    def serde_names(self) -> tuple[str, ...]:
        """The configured serde chain as record headers name it (identity stages left
        out): what a backend that keeps no record header (the ``mock``) stores beside an
        object, to tell after a restart which chain encoded it."""
        return self._state.chain.names

    def serde_chain_mismatch(self, key: ObjectKey, written: Sequence[str]) -> None:
        """``key``'s object was written with the serde chain ``written`` (its
        :attr:`serde_names` then), not the configured one, as a backend that keeps no
        record header finds it (:meth:`read_record_header` does this for one that does).
        Counted (``serde_chain_mismatch``) and logged; the caller answers a miss and keeps
        the object, which core keeps accounted and loads skip until a store of the key
        replaces it -- restoring that chain reads it again."""
        self._state.mark_unreadable(key, written)

    def peek_record_header(self, data: bytes | memoryview, key: ObjectKey) -> RecordHeader | None:
        """Decode and verify a stored header of ``key`` as :meth:`read_record_header` does
        (None: intact, of another serde chain; a ``RecordError`` otherwise), marking and
        noting nothing (counting only a header whose L1 size is impossible: damaged
        whichever record turns out to be the key's).

        For a start-up scan that meets several writes of one key and learns which is the
        key's object only once it is done: a superseded record of another chain must not
        make the key a miss.  Hand the record that turns out to be the key's object to
        :meth:`read_record_header`.
        """
        try:
            header = decode_header(data, expected_key=key, expected_serde=self._state.chain.names)
        except RecordSerdeMismatchError:
            return None
        self._check_l1_size(key, header)
        return header

    def _check_l1_size(self, key: ObjectKey, header: RecordHeader, *, counted: bool = False) -> None:
        """Raise RecordL1SizeError (counted as ``record_l1_size_impossible`` and logged,
        unless ``counted``) for a header whose L1 size no server's object can have: other
        than the payload's length under a chain that changes no sizes.  It would reserve
        the wrong room in L1.  The header crc matched, so this is a forged or miswritten
        record, not a torn one: damaged all the same.

        A size past this server's L1 is no damage: a server with a larger L1 sharing the
        store may have written it.  ``resolve_size`` makes it a miss here (counted, the
        record kept), so it is never reserved in an L1 it cannot fit."""
        # (An L1 size of 0 with a payload is an empty object under a chain whose output of
        # nothing is a few bytes -- zstd's frame, aesgcm's nonce and tag -- not damage.)
        if not self._state.chain.identity or header.l1_size == header.payload_len:
            return
        problem = (
            f"an L1 size of {header.l1_size} bytes for a {header.payload_len}-byte payload, "
            "and the serde chain changes no sizes"
        )
        if not counted:
            self.count("record_l1_size_impossible")
            self.warn(
                "record_l1_size_impossible",
                "the record of %s claims %s; treated as damaged",
                printable(key.file_stem()),
                problem,
            )
        raise RecordL1SizeError(f"record header claims {problem}")

    # -- for wrappers -----------------------------------------------------------------------------

    def open_inner(self, spec: Mapping[str, Any]) -> Any:
        """Build the backend an adapter spec (``{"type": ..., ...}``) describes, inside this
        adapter: one task board, one pin table, one accounting.  Its serde chain runs
        after this adapter's own; its counters go to this adapter's ``stats()`` as
        ``inner_<name>``."""
        from lmcache_tiers.l2.build import open_inner_backend

        return open_inner_backend(self._state, self.name, spec, self._prefix + "inner_")


#: kept records deletes counted that KeptByDelete remembers for the next lookup of their
#: key; beyond it the oldest are forgotten (``kept_delete_marks_forgotten``)
KEPT_MARKS_LIMIT = 4096


class KeptByDelete:
    """The deletes of a backend that reads a record's header before deleting it, and the
    kept records they counted.

    A listing that reads names only accounts other writers' objects under this server's
    names (a record of a key salted "t.bin" as the key salted "t" here); a delete of such
    a key -- the L2 eviction's -- must leave another key's intact record and a newer
    format's, as lookups do.  Core asks right after such a delete whether the key is
    still there, and that lookup reads the same record: it must not count it again.  That
    lookup may never come, so at most :data:`KEPT_MARKS_LIMIT` such records are remembered
    (the oldest forgotten, counted as ``kept_delete_marks_forgotten``).
    """

    def __init__(self, context: BackendContext) -> None:
        self._context = context
        self._lock = threading.Lock()
        #: oldest first (insertion order), at most KEPT_MARKS_LIMIT
        self._counted: dict[ObjectKey, RecordVerdict] = {}

    def keeps(self, key: ObjectKey, header: bytes | memoryview) -> bool:
        """Whether a delete of ``key`` must leave the record whose header ``header`` holds
        (counted, logged and remembered for the next lookup).  A record that is not
        readable at all is the key's to remove."""
        try:
            decode_header(header, expected_key=key)
        except RecordError as exc:
            if self._context.kept_record(key, exc):
                self._remember(key, record_verdict(exc))
                return True
        return False

    def _remember(self, key: ObjectKey, verdict: RecordVerdict) -> None:
        # The lookup that would forget the mark may never come (the absence check is
        # skipped for a pinned key, an open circuit, a close): the oldest marks go once
        # there are KEPT_MARKS_LIMIT.  A forgotten mark only makes that key's next lookup
        # count its record a second time -- the record is a miss either way.
        with self._lock:
            self._counted.pop(key, None)  # re-inserted as the newest
            self._counted[key] = verdict
            excess = len(self._counted) - KEPT_MARKS_LIMIT
            oldest = list(itertools.islice(self._counted, max(excess, 0)))
            for stale in oldest:
                del self._counted[stale]
        if oldest:
            self._context.count("kept_delete_marks_forgotten", len(oldest))
            self._context.warn(
                "kept_delete_marks_forgotten",
                "%d kept records deletes counted were not looked up; forgotten, so their "
                "next lookup counts them again",
                len(oldest),
            )

    def counted(self, key: ObjectKey) -> RecordVerdict | None:
        """The verdict a delete of ``key`` counted since the last lookup asked, if any;
        asking forgets it."""
        with self._lock:
            return self._counted.pop(key, None)

    def kept_record(self, key: ObjectKey, error: RecordError) -> bool:
        """:meth:`BackendContext.kept_record` for a lookup or load, which does not count
        again what the delete before it counted."""
        counted = self.counted(key) is record_verdict(error)
        return self._context.kept_record(key, error, counted=counted)
