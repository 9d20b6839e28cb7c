"""The backend behind ``mooncake_store``: core's records in a Mooncake Store pool.

Object ``key`` is named ``key_prefix + key_to_name(key)`` in the pool, the same name on
every server, and holds a record: a header padded to ``HEADER_BYTES`` (key, lengths,
serde chain, XXH3-128 checksum of the payload) followed by the payload.

* Store: one put session per batch -- reserve the names (a master RPC), write each record
  by a scatter of the header and the payload (an L1 slice, not copied together), publish
  them (a master RPC): the plain put's own two RPCs.  The reservation refuses a name the
  pool already holds, where a plain put keeps the old object and reports success; only
  those names are removed and put again (``store_replaced``), so no existence query
  precedes a put.  A batch that fails after its reservation leaves no session open and
  no object published (``_withdraw``): core accounts none of it.
* Lookup: existence in one batched RPC; the size of a key core already accounts (stored
  through this adapter or listed at start) is core's when no serde chain is configured.
  Only the other hits ask the master for their replicas' sizes (a record's payload is
  its size minus the header), and only for a key core does not know (another server
  stored it), or, under a serde chain, one of another size than core accounts (another
  server stored it again), is the header read too: it tells the L1 size under a
  size-changing serde chain, and whether the record is of this key at all (see
  ``_header``).  A load that finds an object of another size (replaced by another
  writer) is a miss, and that key's next lookup asks the master for its size again.
* Load: per key, the header into a registered lane and the payload straight into the L1
  buffer, exactly the sizes the lookup reported, then the headers and payload checksums
  are verified; anything that does not verify is a miss, and damage is removed.  Into
  the registered L1 arena the batch (up to ``KEYS_PER_LANE`` keys) is read under get
  sessions: one master query for the batch, then ranged reads of header and payload
  (half the CPU of a whole-object read, faster on a busy machine, and without its
  stalls), in a few calls, each call's records verified while the next call reads (see
  ``_load_ranges``).  Into other memory, one scatter read per key for the whole batch,
  then its verification.
* CPU work on payloads (checksums of a store's headers, a load's verification) of
  batches large enough is split between threads, one per core (xxhash releases the
  GIL); stores and loads have helper threads of their own, each at its callers'
  priority (see :mod:`.helpers`).  A load's verification overlaps its ranged reads,
  which leave a core idle much of their time (256 x 1 MiB on 2 cores: ~75 ms of CPU in
  this process and ~45 ms in the segment host over ~85 ms); a scatter read's does not:
  that transfer keeps its calling thread busy polling for completion, so checksums taken
  during it only compete with it for the cores (measured with
  ``bench/bench_mooncake.py``: 8 % slower than reading the whole batch, then verifying
  on both cores).
* Delete: the records' headers are read first (one ranged read per lane of keys), and
  only this server's records are removed: another key's intact record and a newer
  format's (another writer replaced the object under the name) are kept, as lookups
  keep them, and the key's next lookup reads that header again (a miss).
* Objects vanish on their own (Mooncake evicts, a client lending memory stops): a
  vanished object is a miss; core releases the bytes of one it still accounts when a
  lookup, or the check after a delete that found nothing, sees it gone
  (``objects_vanished``).

Deletes and probes wait at most ``operation_timeout_s`` (see :mod:`.calls`); lookups,
stores and loads run on the adapter's threads and are bounded by Mooncake's own timeouts,
set from the same value (stores and loads read or write memory core may reuse once they
return; lookups are on the request path, where a hop to another thread and back costs
more than the RPC).  Mooncake's reconnection to a master that failed a call is not
bounded by those timeouts (about 4 s): until the master answers again, each of them is
preceded by a probe with a deadline, and refused when it is not answered
(``_master_call``).  Close waits for every call inside the client -- given-up deletes
and probes too -- before closing it (``Connection.leased``).  Every
failure of the pool raises, so core's circuit breaker (``remote = True``) opens after
repeated ones and ``ping`` closes it when the master answers again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from lmcache_plugin_mooncake.calls import CallPool, CallTimeout
from lmcache_plugin_mooncake.client import (
    EXISTS,
    NO_ROOM,
    NOT_FOUND,
    RECONNECT_S,
    UNREACHABLE,
    Connection,
    MasterUnreachable,
    MooncakeError,
    describe,
    import_store_module,
)
from lmcache_plugin_mooncake.config import MooncakeStoreConfig
from lmcache_plugin_mooncake.headers import HEADER_BYTES, HeaderLanes, Lane, address_of, chunks
from lmcache_plugin_mooncake.helpers import HelperThreads
from lmcache_plugin_mooncake.listing import iter_pool_names
from lmcache_plugin_mooncake.metadata_plugins import missing_metadata_plugin
from lmcache_plugin_mooncake.sessions import GetSessions
from lmcache_tiers.plugin import (
    BackendContext,
    DeleteMarks,
    FieldError,
    KeptByDelete,
    ObjectKey,
    ObjectSize,
    RecordError,
    RecordVerdict,
    keeps_unlisted,
    key_to_name,
    name_to_key,
    printable,
    record_verdict,
    verify_payload,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: longest object name written (readable names; longer keys get digest names)
MAX_NAME_BYTES = 255
#: names sized per replica query of the start-up listing
_LIST_BATCH = 512
#: names remembered for a fresh size query at most (see ``_size_changed``)
_RESIZED_MAX = 1 << 16
#: a repeated warning is logged at most once per this many seconds
_WARN_EVERY_S = 60.0
#: how many operation_timeout_s a call may stay inside Mooncake: a master RPC, then a
#: transfer's progress and status timeouts (what close waits for it)
_CALL_TIMEOUTS = 3
#: how long a running probe makes the next one wait: well past Mooncake's ~4 s reconnect
#: and its RPC timeouts, so only a probe stuck for good is joined by another
_PROBE_ALONE_S = 30.0
#: probes inside Mooncake at most: one running past ``_PROBE_ALONE_S`` lets one more
#: through, but a master hung for good keeps that one as well, and each later one would
#: hold another deadline-pool thread for good
_PROBES_MAX = 2
#: payload bytes below which checksums are taken on the calling thread alone (handing
#: work to a helper thread costs more than it saves for a few objects)
PARALLEL_MIN_BYTES = 4 << 20
#: payload bytes of the smallest part a ranged load reads in one call (see
#: ``_load_parts``): a call costs more than verifying fewer bytes behind the next one saves
LOAD_PART_MIN_BYTES = 16 << 20


class _Throttle:
    """At most one warning of a kind per window, with the count of the others."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            self._next[kind] = now + _WARN_EVERY_S
            skipped = self._skipped.pop(kind, 0)
        if skipped:
            message += " (and %d more in the last %.0fs)"
            args = (*args, skipped, _WARN_EVERY_S)
        logger.warning(message, *args)


class ObjectNames:
    """Pool names of keys under one prefix, and back."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._max = MAX_NAME_BYTES - len(prefix.encode())

    def of(self, key: ObjectKey) -> str:
        return self.prefix + key_to_name(key, self._max)

    def key(self, name: str) -> ObjectKey | None:
        """The key of a readable name under the prefix; None for digest and foreign names."""
        return name_to_key(name[len(self.prefix) :]) if name.startswith(self.prefix) else None


def _exist(store: Any, names: list[str]) -> list[int]:
    return store.batch_is_exist(names)  # type: ignore[no-any-return]


def _remove(store: Any, names: list[str]) -> list[int]:
    """Checked inside the leased call, where an unanswered code marks the master silent."""
    codes: list[int] = store.batch_remove(names, True)
    _check("remove", codes)
    return codes


def _check(what: str, codes: Sequence[int]) -> None:
    """Fail the whole batch when the master did not answer for some key."""
    unreachable = [code for code in codes if code in UNREACHABLE]
    if unreachable:
        raise MasterUnreachable(
            f"{what}: {describe(unreachable[0])} for {len(unreachable)} of {len(codes)} keys"
        )


def _read_headers(store: Any, lane: Lane, names: list[str]) -> list[int]:
    """Read the record header of each of ``names`` into the slot of ``lane`` of its
    position: per name, the bytes read (``HEADER_BYTES``: whole) or the error code.  The
    batch fails when the master did not answer for some name (``_check``)."""
    codes = store.get_into_ranges(
        [lane.address(0)],
        [names],
        [[[slot * HEADER_BYTES] for slot in range(len(names))]],
        [[[0] for _ in names]],
        [[[HEADER_BYTES] for _ in names]],
    )[0]
    read = [code[0] for code in codes]
    _check("header read", read)
    return read


#: where a record's parts go in its object: the header, then the payload
_RECORD_OFFSETS = [0, HEADER_BYTES]
_HEADER_OFFSET = [0]
#: a transfer that wrote fewer bytes than the record holds
_TRANSFER_FAILED = -800
#: a read into a buffer smaller than the object (Mooncake's "invalid parameters")
_TOO_SMALL = -600
#: a damaged object no longer in the pool when read again (see ``_replaced_since``)
_GONE = "gone"
#: a damaged object that could not be read (or sized) again to tell (``_replaced_since``)
_UNTOLD = "untold"
#: a record not put because removing the old object failed, or because its header
#: does not fit (each counted where it happens)
_GIVEN_UP = 1
_HEADER_TOO_LONG = 2


class _FailBatch:
    """The answer for a key whose unreadable header only failing its whole lookup covers."""


_FAIL_BATCH = _FailBatch()


@dataclass
class _StoreBatch:
    """The records of one ``put_many``, by key: object name, header, record size, payload."""

    names: list[str]
    headers: list[bytes]
    sizes: list[int]
    payloads: list[memoryview]

    def pointers(self, index: int) -> list[int]:
        """Where record ``index``'s parts are (see ``_record_parts``)."""
        header, payload = self.headers[index], self.payloads[index]
        return [address_of(header), address_of(payload)] if payload.nbytes else [address_of(header)]


def _record_parts(payload_bytes: int) -> list[int]:
    """Sizes of a record's parts as they are put and read."""
    return [HEADER_BYTES, payload_bytes] if payload_bytes else [HEADER_BYTES]


@dataclass
class _ChunkCheck:
    """The verification of a chunk a load read, by slot (``codes``: Mooncake's per slot)."""

    backend: MooncakeStoreBackend
    store: Any
    lane: Lane
    keys: list[ObjectKey]
    names: list[str]
    buffers: list[memoryview]
    codes: list[int]
    ok: list[bool]
    offset: int
    sized: bool

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    def slots_of(self, part: Sequence[int]) -> Callable[[Sequence[int]], None]:
        """Work verifying the slots ``part[i]`` for the indexes ``i`` it is given."""

        def check(indexes: Sequence[int]) -> None:
            for index in indexes:
                slot = part[index]
                self.ok[self.offset + slot] = self.backend._check_read(
                    self.store, self.keys[slot], self.names[slot], self.lane.slot(slot),
                    self.buffers[slot], self.codes[slot], self.sized,
                )  # fmt: skip

        return check


#: the name the circuit breaker's probe asks about (no key is named like it)
PROBE_NAME = "lmcache-tiers-probe"


class MooncakeStoreBackend:
    """Stores records in a Mooncake Store pool; see the module docstring."""

    #: core puts its circuit breaker in front: after repeated failures lookups miss at
    #: once and stores are skipped, and ``ping`` probes the master until it answers
    remote = True

    @staticmethod
    def preflight(config: MooncakeStoreConfig) -> None:
        """Before L1 exists, what needs no connection: the Mooncake client imports
        (``BackendUnavailableError`` saying what to install), and it was built with the
        plugin of the configured kind of metadata service -- asked for a kind it lacks,
        Mooncake aborts the process at set-up."""
        missing = missing_metadata_plugin(import_store_module(), config.metadata_server)
        if missing is not None:
            raise FieldError("metadata_server", missing)

    def __init__(self, config: MooncakeStoreConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self.timeout = config.operation_timeout_s
        self.concurrency = config.num_workers
        self.names = ObjectNames(config.key_prefix)
        # Loads and lookups of every worker at once, and spares for calls given up.
        self.lanes = HeaderLanes(2 * config.num_workers + 4)
        l1 = context.l1_buffer
        #: where the L1 arena lies (loads into it are ranged reads, see ``_load_ranges``)
        self._l1_span = (address_of(l1), address_of(l1) + l1.nbytes) if l1 is not None and l1.nbytes else None
        self.connection = Connection(
            config,
            context.name,
            self.lanes,
            context.l1_buffer,
            on_closed_late=self._client_closed_late,
            on_left_unclosed=self._client_left_unclosed,
            on_unclosed_closed=self._unclosed_client_closed,
        )
        self.calls = CallPool(
            context.name, 2 * config.num_workers + 2, exit_wait_s=_CALL_TIMEOUTS * self.timeout + RECONNECT_S
        )
        # Take checksums next to the calling thread: as many threads in all as cores.
        self._parts = max(1, min(os.cpu_count() or 1, config.num_workers + 1))
        helpers = config.num_workers * (self._parts - 1)
        # Each kind at its callers' priority (see .helpers): a store's started by the
        # first store needing one (write-back's), a load's now (the process's).
        self._store_helpers = ThreadPoolExecutor(
            helpers or 1, thread_name_prefix=f"mooncake-{context.name}-sum"
        )
        self._load_helpers = HelperThreads(f"mooncake-{context.name}-verify", helpers)
        self._throttle = _Throttle()
        #: loads reading under each name's get session (see ``_load_ranges``)
        self._sessions = GetSessions()
        #: names whose next lookup must ask the master for their size (see _known_size)
        self._resized: set[str] = set()
        self._resized_lock = threading.Lock()
        #: kept records a delete judged, so the lookup core makes next counts none twice
        self._deletes = KeptByDelete(context)
        #: names whose next lookup must read the record header (a delete kept the record);
        #: a load reads it anyway, so a mark forgotten costs a hit that load turns into a miss
        self._reread: DeleteMarks[str] = DeleteMarks(
            context,
            "reread_marks_forgotten",
            "their next lookup may answer from this server's accounting, and the load after it "
            "reads the kept record and misses",
        )
        #: set while the master is silent: its last call failed unanswered (see _master_call)
        self._master_silent = threading.Event()
        #: probes started and not ended (given up ones included), and when the last began
        self._probes_running = 0
        self._last_probe_started = 0.0
        self._probe_lock = threading.Lock()
        #: notified when a probe ends, on time or late
        self._probe_ended_cond = threading.Condition(self._probe_lock)

    # -- life cycle ------------------------------------------------------------------------

    def open(self) -> None:
        if not self.connection.start(wait_s=self.timeout):
            logger.warning(
                "%s: not connected to the Mooncake pool yet (%s); calls fail until it is, set-up retried",
                self.context.name,
                self.connection.last_error,
            )
        if self.config.master_metrics_url is None and self.config.capacity_bytes:
            logger.info(
                "%s: no master_metrics_url: objects stored before start are accounted when lookups find them",
                self.context.name,
            )

    def close(self) -> None:
        # Core stops waiting for running calls after its close_timeout_s, which may be
        # shorter than operation_timeout_s: a store or load may still be inside Mooncake
        # (reading or writing L1), bounded by Mooncake's timeouts -- a master RPC and a
        # transfer's progress and status, each operation_timeout_s.
        running = self.connection.close(self.timeout, calls_wait_s=_CALL_TIMEOUTS * self.timeout)
        if running:
            self.context.count("close_calls_left_running", running)
            logger.warning(
                "%s: %d calls were still inside Mooncake %.0fs after close began; the client is "
                "left open under them, closed when the last of them ends",
                self.context.name,
                running,
                _CALL_TIMEOUTS * self.timeout,
            )
        self.calls.close()
        self._store_helpers.shutdown(wait=True)
        self._load_helpers.shutdown()

    def _client_closed_late(self) -> None:
        """The client a close left open under running calls was closed as the last ended."""
        self.context.count("close_completed_late")
        logger.info(
            "%s: the Mooncake client left open under running calls at close was closed after the last ended",
            self.context.name,
        )

    def _client_left_unclosed(self, unanswered: str) -> None:
        """The client was left unclosed at close: ``unanswered`` did not answer in time
        (the connection logged it)."""
        self.context.count("close_left_unclosed")

    def _unclosed_client_closed(self) -> None:
        """A client left unclosed at close was closed once both services answered again
        (the connection logged it)."""
        self.context.count("unclosed_clients_closed_later")

    def _call_leased(self, what: str, function: Callable[..., T], *args: Any) -> T:
        """``function(store, *args)`` on the deadline pool, the client leased while it runs:
        a call given up at its deadline may still be inside Mooncake, and close must not
        close the client under it (``Connection.leased``)."""
        result: T = self.calls.run(what, self.timeout, self._leased, function, *args)
        return result

    def _leased(self, function: Callable[..., T], *args: Any) -> T:
        with self.connection.leased() as store:
            try:
                return function(store, *args)
            except MasterUnreachable:
                self._master_silent.set()
                raise

    @contextmanager
    def _master_call(self, what: str) -> Iterator[Any]:
        """The leased client for one store, lookup or load on the adapter's own thread.

        Once the master has failed a call, Mooncake's client reconnects inside every
        later call: about 4 s of fixed connection retries (measured against a killed
        master: not shortened by ``MC_RPC_TIMEOUT_MS``, ``MC_RPC_CONNECT_TIMEOUT_MS`` or
        ``MC_RETRY_CNT``), whatever ``operation_timeout_s``.  Such a call cannot be given
        up (stores and loads use L1 memory core reuses once they return), so while the
        master is silent a probe bounded by ``operation_timeout_s`` goes first, and the
        call is refused unless the master answers it."""
        if self._master_silent.is_set():
            self._probe_before(what)
        with self.connection.leased() as store:
            try:
                yield store
            except MasterUnreachable:
                self._master_silent.set()
                raise

    def _probe_before(self, what: str) -> None:
        """Return if the silent master answers a probe within the timeout; else the
        call is not made (counted, logged, raised: core counts a backend error)."""
        try:
            self.ping()
        except Exception as exc:
            self.context.count("calls_refused_master_silent")
            self._throttle.warn(
                "master_silent", "%s: %s not made: the Mooncake master did not answer a probe "
                "within %gs since it failed a call (%s)", self.context.name, what, self.timeout, exc,
            )  # fmt: skip
            raise MooncakeError(f"{what} not made: the Mooncake master does not answer ({exc})") from exc

    def ping(self) -> None:
        """Raise unless the master answers an existence query within the timeout; the
        answer (or its absence) also says whether the master is silent (``_master_call``)."""
        code = self._probe_code()
        if code in UNREACHABLE:
            self._master_silent.set()
        if code < 0:
            raise MooncakeError(f"existence query returned {describe(code)}")
        self._master_silent.clear()

    def _probe_code(self) -> int:
        """The code of one existence query of the probe name on the deadline pool, or an
        error.  One probe at a time: a probe given up at its deadline may stay inside
        Mooncake for its ~4 s reconnect, and one per call made meanwhile (stores, lookups
        and loads of every worker, the circuit's probes) would fill the deadline pool with
        them -- deletes waiting behind -- and leave daemon threads inside Mooncake; the
        master has not answered the running one, so a second is refused at once (unless
        the running one has been inside Mooncake for ``_PROBE_ALONE_S``: a call stuck for
        good must not keep the circuit open for good).  A probe that finds another running
        waits for it up to the timeout first: a master that was frozen and answers again
        ends the running one late, and the calls made meanwhile must then be served, not
        refused because an earlier probe had not come back yet.  No more than
        ``_PROBES_MAX`` probes are ever inside: past that a probe is refused at once."""
        with self._probe_lock:
            deadline = time.monotonic() + self.timeout
            while self._probes_running and time.monotonic() - self._last_probe_started < _PROBE_ALONE_S:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MooncakeError("the master has not answered the probe sent before (still running)")
                self._probe_ended_cond.wait(left)
            stuck = self._probes_running
            if stuck < _PROBES_MAX:
                self._probes_running += 1
                self._last_probe_started = time.monotonic()
        if stuck >= _PROBES_MAX:
            self._probe_refused_stuck(stuck)
        given_up = False
        code: int  # _exist's, which the pass through _leased hides from the checker
        try:
            (code,) = self.calls.run(
                "probe", self.timeout, self._leased, _exist, [PROBE_NAME], on_late=self._probe_ended
            )
        except CallTimeout:
            given_up = True  # on_late ends it
            self._master_silent.set()
            raise
        finally:
            if not given_up:
                self._probe_ended()
        return code

    def _probe_refused_stuck(self, stuck: int) -> None:
        """Refuse a probe: ``stuck`` probes are inside Mooncake already, unanswered for
        ``_PROBE_ALONE_S`` (counted, logged, raised: the master is taken as silent)."""
        self.context.count("probes_refused_stuck")
        self._throttle.warn(
            "probes_stuck", "%s: probe of the Mooncake master not made: %d probes have been inside "
            "Mooncake unanswered for %.0fs or more", self.context.name, stuck, _PROBE_ALONE_S,
        )  # fmt: skip
        raise MooncakeError(f"the master has not answered the {stuck} probes still inside Mooncake")

    def _probe_ended(self) -> None:
        with self._probe_lock:
            self._probes_running -= 1
            self._probe_ended_cond.notify_all()

    def capacity(self) -> int | None:
        return self.config.capacity_bytes

    def stats(self) -> dict[str, int]:
        return {
            "connected": int(self.connection.connected),
            "connect_failures": self.connection.failures,
            "l1_registered": int(self.connection.l1_registered),
            "calls_in_mooncake": self.calls.busy,
            "header_lanes_free": self.lanes.free,
        }

    def _in_parallel(
        self,
        helpers: ThreadPoolExecutor | HelperThreads,
        work: Callable[[Sequence[int]], None],
        count: int,
        nbytes: int,
    ) -> None:
        """``work`` over ``range(count)``, split between this thread and ``helpers`` when
        the items hold at least ``PARALLEL_MIN_BYTES``; the first exception raised is
        raised here once every part ended (parts write disjoint items only)."""
        parts = min(self._parts, count) if nbytes >= PARALLEL_MIN_BYTES else 1
        if parts <= 1:
            work(range(count))
            return
        # Interleaved parts: payloads of one batch are mostly of one size.
        helping = [helpers.submit(work, range(part, count, parts)) for part in range(1, parts)]
        try:
            work(range(0, count, parts))
        finally:
            wait(helping)
        for future in helping:
            future.result()

    # -- store -----------------------------------------------------------------------------

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        with self._master_call("store") as store:
            return self._put_many(store, keys, payloads)

    def _put_many(self, store: Any, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        batch = _StoreBatch(
            [self.names.of(key) for key in keys],
            [b""] * len(keys),
            [HEADER_BYTES + payload.nbytes for payload in payloads],
            list(payloads),
        )
        reserved = self._reserve_and_encode(store, batch, keys)
        codes = self._put(store, batch, list(range(len(keys))), reserved)
        existing = [index for index, code in enumerate(codes) if code == EXISTS]
        if existing:
            # The pool holds these names already: the reservation refused them (a plain
            # put would keep the old object and still report success), so replace them.
            try:
                again = self._remove_existing(store, batch.names, codes, existing)
                for index, code in zip(again, self._put(store, batch, again), strict=True):
                    codes[index] = code
            except BaseException:
                # The batch fails whole, so core accounts none of it: what the first put
                # published must not stay behind for a later lookup to find.
                self._withdraw(
                    store, [name for name, code in zip(batch.names, codes, strict=True) if code == 0]
                )
                raise
        ok = [False] * len(keys)
        for index, (name, code) in enumerate(zip(batch.names, codes, strict=True)):
            if code == 0:
                ok[index] = True
            elif code == NO_ROOM:
                self.context.count("store_no_room")
                self._throttle.warn(
                    "room", "%s: the Mooncake pool has no room for %s", self.context.name, name
                )
            elif code not in (_GIVEN_UP, _HEADER_TOO_LONG):
                self.context.count("store_failures")
                self._throttle.warn(
                    "put", "%s: put of %s returned %s", self.context.name, name, describe(code)
                )
        return ok

    def _reserve_and_encode(self, store: Any, batch: _StoreBatch, keys: Sequence[ObjectKey]) -> list[int]:
        """Compute the record headers (the payloads' checksums), then reserve the names in
        the pool; the reservation's code per key.

        Not overlapped: handing the checksum of one object to another thread while this
        one waits for the reservation cost more than it hid (the hand-off and the other
        thread's wake-up, at write-back priority, against a 0.1 ms RPC)."""

        def encode(indexes: Sequence[int]) -> None:
            for index in indexes:
                batch.headers[index] = self.context.record_header(
                    keys[index], batch.payloads[index], align=HEADER_BYTES
                )

        self._in_parallel(self._store_helpers, encode, len(keys), sum(batch.sizes))
        writable = [index for index, header in enumerate(batch.headers) if len(header) == HEADER_BYTES]
        reserved = [_HEADER_TOO_LONG] * len(keys)
        for index, header in enumerate(batch.headers):
            if len(header) != HEADER_BYTES:
                self.context.count("record_header_too_long")
                self._throttle.warn(
                    "header", "%s: %s not stored: its record header needs %d bytes, more than %d",
                    self.context.name, printable(keys[index].file_stem()), len(header), HEADER_BYTES,
                )  # fmt: skip
        if writable:
            names = [batch.names[i] for i in writable]
            codes = store.batch_put_session_start(names, [batch.sizes[i] for i in writable])
            self._check_reservation(store, names, codes)
            for index, code in zip(writable, codes, strict=True):
                reserved[index] = code
        return reserved

    def _put(
        self, store: Any, batch: _StoreBatch, indexes: list[int], reserved: list[int] | None = None
    ) -> list[int]:
        """Put the records ``indexes`` of ``batch`` in one put session (reserved first
        unless ``reserved`` says how that went): Mooncake's code per record (0: stored,
        ``EXISTS``: the pool holds the name, nothing written).

        A session is the plain put's own two master RPCs (reserve, then publish), called
        one by one: its reservation refuses names the pool holds, where a plain put
        keeps the old object and reports success, so no existence query is needed."""
        names = [batch.names[i] for i in indexes]
        sizes = [batch.sizes[i] for i in indexes]
        if reserved is None:
            reserved = list(store.batch_put_session_start(names, sizes))
            self._check_reservation(store, names, reserved)
        codes = list(reserved)
        started = [position for position, code in enumerate(codes) if code == 0]
        if not started:
            return codes
        try:
            written = store.batch_put_from_multi_buffer_ranges(
                [names[p] for p in started],
                [batch.pointers(indexes[p]) for p in started],
                [_record_parts(sizes[p] - HEADER_BYTES) for p in started],
                [_RECORD_OFFSETS if sizes[p] > HEADER_BYTES else _HEADER_OFFSET for p in started],
            )
            _check("put", written)
        except BaseException:
            self._revoke(store, [names[p] for p in started])
            raise
        for position, got in zip(started, written, strict=True):
            codes[position] = 0 if got == sizes[position] else (got if got < 0 else _TRANSFER_FAILED)
        self._revoke(store, [names[p] for p in started if codes[p] != 0])
        done = [p for p in started if codes[p] == 0]
        if done:
            ending = [names[p] for p in done]
            try:
                ended = store.batch_put_session_end(ending)
                _check("put", ended)
            except BaseException:
                # Some may be published, the rest still reserved (a session never ended
                # holds its pool memory and refuses the name to every writer): the batch
                # fails, so none of them may stay.
                self._withdraw(store, ending)
                raise
            for position, code in zip(done, ended, strict=True):
                codes[position] = code
            self._revoke(store, [names[p] for p in done if codes[p] != 0])
        return codes

    def _check_reservation(self, store: Any, names: list[str], codes: list[int]) -> None:
        """``_check`` of a reservation: when the master did not answer for some names, the
        ones it did reserve are given back before the batch fails."""
        try:
            _check("put", codes)
        except MooncakeError:
            self._revoke(store, [name for name, code in zip(names, codes, strict=True) if code == 0])
            raise

    def _revoke(self, store: Any, names: list[str]) -> None:
        """Give up reserved names whose data did not arrive (the master would discard
        them only after its own timeout, keeping them from other writers until then).
        Those the master was not told of are counted (``withdraw_failures``) and logged."""
        if not names:
            return
        try:
            codes = list(store.batch_put_session_revoke(names))
        except Exception as exc:  # the put already failed; its failure is what is raised
            left, why = len(names), str(exc)
        else:
            unanswered = [code for code in codes if code in UNREACHABLE]
            left, why = len(unanswered), describe(unanswered[0]) if unanswered else ""
            others = [code for code in codes if code not in (0, NOT_FOUND, *UNREACHABLE)]
            if others:  # no session left to give up (the master discarded it)
                self._throttle.warn(
                    "revoke", "%s: revoking a failed put returned %s", self.context.name, describe(others[0])
                )
        if left:
            self.context.count("withdraw_failures", left)
            self._throttle.warn(
                "revoke_left", "%s: %d reservations of a failed put could not be given up (%s): "
                "their names are refused to every writer until the master's own timeout",
                self.context.name, left, why,
            )  # fmt: skip

    def _withdraw(self, store: Any, names: list[str]) -> None:
        """Leave none of ``names`` reserved or visible after their batch failed: each is
        revoked (a session not ended) and, where there was no session to revoke (its end
        got through), removed.  What cannot be withdrawn is counted and logged: a session
        left runs out with the master's timeout, a published record is complete and
        verified, and a later lookup accounts it."""
        if not names:
            return
        try:
            revoked = store.batch_put_session_revoke(names)
            published = [name for name, code in zip(names, revoked, strict=True) if code != 0]
            removed = store.batch_remove(published, True) if published else []
            left = sum(code not in (0, NOT_FOUND) for code in removed)
            outcome = f"{left} could not be removed" if left else "none left"
        except Exception as exc:  # the batch's own failure is what is raised
            left, outcome = len(names), f"withdrawing failed: {exc}"
        self.context.count("store_withdrawn", len(names) - left)
        self.context.count("withdraw_failures", left)
        self._throttle.warn(
            "withdraw",
            "%s: a failed put batch: %d reserved or published objects withdrawn (%s)",
            self.context.name,
            len(names),
            outcome,
        )

    def _remove_existing(
        self, store: Any, names: list[str], codes: list[int], indexes: list[int]
    ) -> list[int]:
        """Remove the objects the pool held under ``names[i]`` for ``i`` in ``indexes``;
        the indexes that may be put again (the others are marked given up in ``codes``)."""
        removed = store.batch_remove([names[i] for i in indexes], True)
        _check("remove", removed)
        again: list[int] = []
        for position, code in zip(indexes, removed, strict=True):
            name = names[position]
            if code in (0, NOT_FOUND):
                again.append(position)
                continue
            codes[position] = _GIVEN_UP
            self.context.count("store_failures")
            self._throttle.warn(
                "replace", "%s: %s not replaced: remove returned %s", self.context.name, name, describe(code)
            )
        self.context.count("store_replaced", len(again))
        return again

    # -- lookup ----------------------------------------------------------------------------

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        # On the calling thread: a lookup is master RPCs (and, rarely, a header read),
        # each ended by Mooncake's own timeouts, and a hop to a deadline pool and back
        # cost two thread wake-ups on every lookup (the request path).
        with self._master_call("lookup") as store:
            return self._contains(store, list(keys), [self.names.of(key) for key in keys])

    def _contains(self, store: Any, keys: list[ObjectKey], names: list[str]) -> list[int | ObjectSize | None]:
        present = store.batch_is_exist(names)
        _check("existence query", present)
        if any(code < 0 for code in present):
            raise MooncakeError(f"existence query returned {describe(min(present))}")
        reread = self._reread_taken([names[i] for i, code in enumerate(present) if code == 1])
        try:
            return self._found_sizes(store, keys, names, present, reread)
        except BaseException:
            # Unread, those records would be taken for this server's by the next lookup
            # (a hit from core's accounting alone): it must read them again.
            if reread:
                self._reread.add_all(reread)
            raise

    def _found_sizes(
        self, store: Any, keys: list[ObjectKey], names: list[str], present: list[int], reread: set[str]
    ) -> list[int | ObjectSize | None]:
        """The answer of a lookup whose existence query said ``present``; ``reread``: the
        names whose record must be read again (a delete kept it)."""
        found: list[int | ObjectSize | None] = [None] * len(keys)
        unsized: list[int] = []
        for index, code in enumerate(present):
            if code != 1:
                continue
            known = None if names[index] in reread else self._known_size(keys[index], names[index])
            if known is None:
                unsized.append(index)
            else:
                found[index] = known
        sizes = self._record_sizes(store, [names[i] for i in unsized])
        need_header: list[int] = []
        for index in unsized:
            size = sizes.get(names[index])
            if size is None:
                continue  # gone since the existence query, or still being written
            if size < HEADER_BYTES:
                self._remove_damaged(
                    store, keys[index], names[index], f"{size} bytes, shorter than a record header", size
                )
                continue
            found[index] = size - HEADER_BYTES
            if self._sized_by_header(keys[index], size - HEADER_BYTES) or names[index] in reread:
                # A record a delete kept is read again: it is not this server's (a miss).
                need_header.append(index)
        for chunk in chunks(len(need_header)):
            self._sizes_from_headers(store, keys, names, [need_header[i] for i in chunk], found, reread)
        return found

    def _sized_by_header(self, key: ObjectKey, stored: int) -> bool:
        """Whether a lookup that found ``key``'s object holding ``stored`` payload bytes
        reads its record header: when core does not know the key (another server stored
        it) -- the header tells the L1 size under a size-changing chain, and whether the
        record is of this key at all (a server whose key_prefix extends this one's names
        its objects as this server names other keys, and a hit would account that object
        here) -- and, under a chain, when ``stored`` is not the size core accounts: a
        server whose chain differs only in a serde's options (zstd's level) stored the key
        again, and only the header tells the L1 size of its record."""
        if self.context.l1_size_of(key) is None:
            return True
        if not self.context.serde:
            return False  # the stored size is the L1 size
        accounted = self.context.accounted_size(key)
        return accounted is None or accounted.stored != stored

    def _unread_answer(
        self, key: ObjectKey, name: str, stored: int | ObjectSize | None, reread: set[str]
    ) -> int | _FailBatch | None:
        """What a lookup answers for an existing object whose record header could not be
        read (a miss either way); ``_FAIL_BATCH`` when only failing the whole batch is safe.

        Under a serde chain the stored payload size alone is a miss that releases
        nothing: core cannot derive the L1 size from it (``lookup_size_unknown``), and
        unlike an absent answer it does not take the key for removed.  Without a chain
        core would take that size for a hit of a record never verified to be this
        key's; absent is the miss then, which releases nothing of a key core does not
        account (another server stored it).  So the object of a segment host that died,
        still listed until the master drops the segment, misses its own key, not every
        key of the lookup: failed lookups, repeated, would open the circuit that guards
        the master while the master answers.  An accounted key would be released as
        removed behind the adapter's back, and a name a delete kept (``reread``) must be
        read, not answered."""
        if name in reread:
            return _FAIL_BATCH
        if self.context.serde and isinstance(stored, int):
            return stored
        if self.context.l1_size_of(key) is None:
            return None
        return _FAIL_BATCH

    def _known_size(self, key: ObjectKey, name: str) -> int | None:
        """The payload size of an existing object when core already knows it: without a
        serde chain the stored size is the L1 size core accounts (a store's or the
        listing's).  None where the master must be asked: a chain is configured, core
        does not know the key, or a load found the object of another size."""
        if self.context.serde:
            return None
        if self._resized:  # rare: not worth the lock on every hit otherwise
            with self._resized_lock:
                if name in self._resized:
                    self._resized.discard(name)
                    return None
        return self.context.l1_size_of(key)

    def _reread_taken(self, names: list[str]) -> set[str]:
        """The ``names`` whose record a delete kept (another key's, a newer format's),
        forgotten as they are returned: their lookup reads the header, which makes them
        a miss here -- core then releases what it accounts for them."""
        if not self._reread:  # rare: not worth the lock on every lookup otherwise
            return set()
        return self._reread.take_all(names)

    def _size_changed(self, name: str) -> None:
        """A load found ``name`` not of the size reported: its next lookup asks the master."""
        with self._resized_lock:
            if len(self._resized) >= _RESIZED_MAX:
                self._resized.clear()  # the names then get one needless replica query each
            self._resized.add(name)

    def _record_sizes(self, store: Any, names: list[str]) -> dict[str, int]:
        """Size of each name's complete replica (names without one are left out)."""
        if not names:
            return {}
        replicas = store.batch_get_replica_desc(names)
        if not replicas:
            # Mooncake answers {} both when the master did not answer and when none of the
            # names has a complete replica any more (removed or evicted since they were
            # listed or found): ask again whether they exist, which says which it was.
            present = store.batch_is_exist(names)
            _check("replica query", present)
            if any(code != 0 for code in present):
                raise MooncakeError(f"replica query answered nothing for {len(names)} existing keys")
            return {}
        complete = self.connection.module.ReplicaStatus.COMPLETE
        sizes: dict[str, int] = {}
        for name, descriptors in replicas.items():
            for replica in descriptors:
                if replica.status != complete:
                    continue
                if replica.is_memory_replica():
                    sizes[name] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
                if replica.is_disk_replica():
                    sizes[name] = int(replica.get_disk_descriptor().object_size)
                    break
        return sizes

    def _sizes_from_headers(
        self,
        store: Any,
        keys: list[ObjectKey],
        names: list[str],
        indexes: list[int],
        found: list[int | ObjectSize | None],
        reread: set[str],
    ) -> None:
        """Replace ``found[i]`` by both sizes from the record header (None: a miss; the
        stored size alone: a header that could not be read, see ``_unread_answer``)."""
        disagreeing: list[tuple[int, Any, Any, bytes]] = []  # index, size queried, header, its bytes
        unread = 0  # headers whose read failed that no per-key answer covers
        with self.lanes.lane(self.timeout) as lane:
            codes = _read_headers(store, lane, [names[i] for i in indexes])
            for slot, (index, code) in enumerate(zip(indexes, codes, strict=True)):
                stored = found[index]
                found[index] = None
                if code != HEADER_BYTES:
                    if code != NOT_FOUND:
                        answer = self._unread_answer(keys[index], names[index], stored, reread)
                        if isinstance(answer, _FailBatch):
                            unread += 1
                        else:
                            found[index] = answer
                        self.context.count("header_read_failures")
                        self._throttle.warn(
                            "header_read", "%s: reading the record header of %s returned %s: a miss",
                            self.context.name, names[index], describe(code),
                        )  # fmt: skip
                    continue
                read_size = HEADER_BYTES + stored  # type: ignore[operator]  # the replica's: an int
                header = self._header(store, keys[index], names[index], lane.slot(slot), read_size)
                if header is not None and header.payload_len != stored:
                    disagreeing.append((index, stored, header, bytes(lane.slot(slot))))
                elif header is not None:
                    found[index] = ObjectSize(header.payload_len, header.l1_size)
        if unread:
            # Answered absent, such a key would have its accounted bytes released by core
            # as removed behind its back: the batch fails instead, every key a miss.
            raise MooncakeError(f"header read: {unread} of {len(indexes)} record headers could not be read")
        if not disagreeing:
            return
        # The size was queried before the header was read: another writer may have
        # replaced the object in between.  Only a record still of the size queried is
        # damage; one now of its header's size is the replacement (valid, kept).
        sizes = self._record_sizes(store, [names[index] for index, _, _, _ in disagreeing])
        for index, stored, header, judged in disagreeing:
            size = sizes.get(names[index])
            if size == HEADER_BYTES + header.payload_len:
                found[index] = ObjectSize(header.payload_len, header.l1_size)
            elif size is not None and size == HEADER_BYTES + stored:
                self._remove_damaged(
                    store, keys[index], names[index], "payload length differs from its header", size, judged
                )
            # else: replaced again or gone since -- a miss, left alone

    # -- load ------------------------------------------------------------------------------

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self._master_call("load") as store:
            return self._get_many_into(store, keys, buffers)

    def _get_many_into(
        self, store: Any, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]
    ) -> list[bool]:
        ok = [False] * len(keys)
        # A chunk's header lane is given back once all of its headers are verified.
        for chunk in chunks(len(keys)):
            if self.context.closing and chunk.start:
                self._skipped_closing(len(keys) - chunk.start)
                break
            chunk_keys, chunk_buffers = [keys[i] for i in chunk], [buffers[i] for i in chunk]
            ranged = self._in_registered_l1(chunk_buffers)
            with self.lanes.lane(self.timeout) as lane:
                self._load_chunk(store, lane, chunk_keys, chunk_buffers, ranged, ok, chunk.start)
        return ok

    def _skipped_closing(self, left: int) -> None:
        """The last ``left`` keys of a load not read: the adapter is closing, and a close
        must not wait for one Mooncake call after another (each key fails, counted)."""
        self.context.count("load_skipped_closing", left)
        self._throttle.warn(
            "load_closing", "%s: closing: the last %d keys of a load were not read (misses)",
            self.context.name, left,
        )  # fmt: skip

    def _load_chunk(
        self,
        store: Any,
        lane: Lane,
        keys: list[ObjectKey],
        buffers: list[memoryview],
        ranged: bool,
        ok: list[bool],
        offset: int,
    ) -> None:
        """Read a chunk's records -- headers into the lane, payloads into their buffers --
        and verify them: ``ok[offset + slot]`` for each that does.  ``ranged``: the
        buffers lie in the registered L1 arena (see ``_load_ranges``); else one scatter
        read per key, then the verification."""
        names = [self.names.of(key) for key in keys]
        if ranged:
            self._load_ranges(store, lane, keys, names, buffers, ok, offset)
            return
        pointers = [self._record_pointers(lane, slot, buffer) for slot, buffer in enumerate(buffers)]
        sizes = [_record_parts(buffer.nbytes) for buffer in buffers]
        codes = store.batch_get_into_multi_buffers(names, pointers, sizes)
        _check("get", codes)
        verify = _ChunkCheck(self, store, lane, keys, names, buffers, codes, ok, offset, sized=True)
        self._in_parallel(self._load_helpers, verify.slots_of(range(len(keys))), len(keys), verify.nbytes)

    def _in_registered_l1(self, buffers: list[memoryview]) -> bool:
        """Whether every buffer lies in the L1 arena and the client has it registered
        (a ranged read refuses memory Mooncake did not register)."""
        if self._l1_span is None or not self.connection.l1_registered:
            return False
        start, end = self._l1_span
        for buffer in buffers:
            if buffer.nbytes and not start <= address_of(buffer) <= end - buffer.nbytes:
                return False
        return True

    def _load_parts(self, buffers: list[memoryview]) -> list[range]:
        """The consecutive parts a ranged chunk is read in, each verified while the next
        is read (see ``_load_ranges``): each part half of the bytes left, down to
        ``LOAD_PART_MIN_BYTES``, so the last part -- whose verification nothing hides --
        is small, in few calls (256 x 1 MiB: 128, 64, 32, 16 and 16 MiB)."""
        left = sum(buffer.nbytes for buffer in buffers)
        parts: list[range] = []
        start = 0
        # One core: no helper thread to verify on while the next part is read.
        while self._parts > 1 and left >= 2 * LOAD_PART_MIN_BYTES:
            end, taken = start, 0
            while end < len(buffers) and taken < left // 2:
                taken += buffers[end].nbytes
                end += 1
            if end == len(buffers):  # one key holds half the bytes left: the last part
                break
            parts.append(range(start, end))
            start, left = end, left - taken
        parts.append(range(start, len(buffers)))
        return parts

    def _load_ranges(
        self,
        store: Any,
        lane: Lane,
        keys: list[ObjectKey],
        names: list[str],
        buffers: list[memoryview],
        ok: list[bool],
        offset: int,
    ) -> None:
        """The chunk's records read under get sessions (see :mod:`.sessions`) and verified.
        The master is asked for the replicas of the whole chunk once, then per key one
        ranged transfer reads the header into its lane slot and the payload into its
        buffer, many keys per call.  Measured on TCP, 256 x 1 MiB, such a call against
        the same two ranges read by ``get_into_ranges`` (which asks the master inside the
        call), alternating in one process: 0.88-0.96x the time, and one record at a time
        a p50 0.03 ms lower and a lower p99.  Both take about half the CPU of
        ``batch_get_into_multi_buffers`` (which polls for completion on the calling
        thread) and lack its ~3 ms transfer stalls, which made them 0.6-0.7x its time on
        a busy machine.

        The chunk is read in parts (``_load_parts``), each verified on a helper thread
        while the next is read -- the sessions started once before the first and ended
        once after the last -- and the last verified on this thread and the helpers.
        Nothing returns before every part's verification ended: ``ok`` is set by it
        alone, and the header lane it reads is given back after.  Once the adapter
        closes, the parts not read yet are not (misses, ``load_skipped_closing``).

        A ranged read does not fail on an object larger than the ranges (another
        writer's record of another size): its header then disagrees with the payload
        size, and the object is read again before it is judged (``_remove_damaged``)."""
        codes = [0] * len(names)
        # A ranged read proves no size: it does not fail on a larger object.
        verify = _ChunkCheck(self, store, lane, keys, names, buffers, codes, ok, offset, sized=False)
        parts = self._load_parts(buffers)
        verifying: list[Future[None]] = []
        try:
            with self._sessions.started(store, names) as started:
                _check("get", started)
                # a session that did not start: the object is gone (NOT_FOUND) or the code says why
                codes[:] = started
                read: list[range] = []
                for part in parts:
                    if read and self.context.closing:
                        # as between chunks: a close must not wait for one call after another
                        self._skipped_closing(len(names) - part.start)
                        break
                    if read:
                        verifying.append(
                            self._load_helpers.submit(verify.slots_of(read[-1]), range(len(read[-1])))
                        )
                    self._read_ranges(store, lane, names, buffers, codes, part)
                    read.append(part)
            last = read[-1]
            nbytes = sum(buffers[slot].nbytes for slot in last)
            self._in_parallel(self._load_helpers, verify.slots_of(last), len(last), nbytes)
        finally:
            wait(verifying)
        for future in verifying:
            future.result()

    def _read_ranges(
        self,
        store: Any,
        lane: Lane,
        names: list[str],
        buffers: list[memoryview],
        codes: list[int],
        part: range,
    ) -> None:
        """One call reading the records of ``part`` whose sessions started (``codes`` 0),
        and their codes (``_load_chunk``'s) in ``codes``."""
        reading = [slot for slot in part if codes[slot] == 0]
        if not reading:
            return
        answer = store.batch_get_into_multi_buffer_ranges(
            [names[slot] for slot in reading],
            [self._record_pointers(lane, slot, buffers[slot]) for slot in reading],
            [_record_parts(buffers[slot].nbytes) for slot in reading],
            [_RECORD_OFFSETS if buffers[slot].nbytes else _HEADER_OFFSET for slot in reading],
        )
        for slot, code in zip(reading, answer, strict=True):
            whole = HEADER_BYTES + buffers[slot].nbytes
            codes[slot] = code if code < 0 or code == whole else _TRANSFER_FAILED
        _check("get", [codes[slot] for slot in reading])

    @staticmethod
    def _record_pointers(lane: Lane, slot: int, buffer: memoryview) -> list[int]:
        """Where record ``slot``'s parts are read to: its lane slot, then its buffer."""
        return [lane.address(slot), address_of(buffer)] if buffer.nbytes else [lane.address(slot)]

    def _check_read(
        self,
        store: Any,
        key: ObjectKey,
        name: str,
        slot: memoryview,
        buffer: memoryview,
        code: int,
        sized: bool,
    ) -> bool:
        """Whether a record read with Mooncake's ``code`` into ``slot`` and ``buffer``
        verifies; ``sized``: the read failed on an object not of the size read."""
        if code == HEADER_BYTES + buffer.nbytes:
            return self._verified(store, key, name, slot, buffer, sized)
        if code == NOT_FOUND:
            self.context.count("load_vanished")
            return False
        # -600, -800: the object is not the size the lookup reported (replaced since by
        # another writer), or -800: its segment host died or hangs (the transfer
        # failed), or -600: its get session was dropped by another load's failed start
        # (see .sessions): a miss, and the next lookup sizes it again
        self._size_changed(name)
        self.context.count("load_failures")
        self._throttle.warn("get", "%s: get of %s returned %s", self.context.name, name, describe(code))
        return False

    def _verified(
        self, store: Any, key: ObjectKey, name: str, slot: memoryview, payload: memoryview, sized: bool
    ) -> bool:
        """Whether the record read into ``slot`` and ``payload`` verifies; ``sized``: the
        read proved the object of exactly that size (else its judgment must ask)."""
        size = HEADER_BYTES + payload.nbytes
        header = self._header(store, key, name, slot, size, loading=True)
        if header is None:
            return False
        if header.payload_len != payload.nbytes:
            why = "payload length differs from its header"
            self._remove_damaged(store, key, name, why, size, slot, sized=sized)
            return False
        try:
            verify_payload(header, payload)
        except RecordError as exc:
            self._remove_damaged(store, key, name, str(exc), size, slot, payload, sized=sized)
            return False
        return True

    def _header(
        self, store: Any, key: ObjectKey, name: str, slot: memoryview, size: int, *, loading: bool = False
    ) -> Any:
        """The verified header in ``slot``, read from an object of ``size`` bytes (by a load
        when ``loading``, else by a lookup); None for a miss (damage is removed)."""
        try:
            header = self.context.read_record_header(slot, key)
        except RecordError as exc:
            # kept: another key's (a server whose key_prefix extends, or is extended by,
            # this one's) or a newer format's; damage is removed
            if not self._deletes.kept_record(key, exc):
                self._remove_damaged(store, key, name, str(exc), size, slot)
            elif loading and self.context.l1_size_of(key) is not None:
                # The next lookup reads it again, a miss, so core releases what it
                # accounts for the key: answered from that accounting (no header read),
                # it would be a hit that every load fails, each reading the whole record.
                # (Not that lookup itself: its miss is that release, and marking the name
                # again would have the key's next record -- this server's -- read too.)
                self._reread.add(name)
            return None
        if header is not None and header.header_len != HEADER_BYTES:
            why = f"header of {header.header_len} bytes, not {HEADER_BYTES}"
            self._remove_damaged(store, key, name, why, size, slot)
            return None
        return header  # None: written with another serde chain, kept (core counts it)

    def _remove_damaged(
        self,
        store: Any,
        key: ObjectKey,
        name: str,
        why: str,
        size: int,
        header: memoryview | bytes | None = None,
        payload: memoryview | None = None,
        *,
        sized: bool = True,
    ) -> None:
        """Remove the object under ``name``, judged damaged (``why``) by a read that found
        ``size`` bytes there, and in them ``header`` and ``payload`` (the parts judged) --
        only if it still holds them.  ``header`` is the lane slot it was read into (read
        again there), or a copy once that lane was given back.  ``sized``: the read
        proved the object ``size`` bytes long (a ranged read does not).

        Mooncake has no conditional remove, and another writer may have replaced the
        object since it was read -- or while it was read, the read torn between the two:
        the object there now is then that writer's valid record, whose store it
        acknowledged, and removing it for the old one's damage would lose it.  So the
        object is read again first and kept when it differs (a miss all the same,
        counted: ``corrupt_reads_replaced``); only a replacement in the instant between
        that read and the removal is removed.  An object that cannot be read again is
        removed as judged -- if its judged read proved its size: else it may be another
        writer's larger record (a miss, ``load_failures``, kept and sized again).  Once
        removed (or found gone), its bytes are released (``record_removed``); one whose
        removal fails stays, counted ``corrupt_remove_failures``."""
        accounted = self.context.accounted_size(key)  # before: a store settling since keeps its own
        changed = self._replaced_since(store, name, size, header, payload)
        if changed is _UNTOLD and not sized:
            self._size_changed(name)
            self.context.count("load_failures")
            self._throttle.warn(
                "damaged_untold", "%s: the record of %s read did not verify (%s), and the object "
                "could not be read again to tell whether another writer replaced it: a miss, kept",
                self.context.name, printable(key.file_stem()), why,
            )  # fmt: skip
            return
        if changed is _UNTOLD:
            changed = None
        if changed is not None and changed is not _GONE:
            # Of another size, perhaps: a ranged read (see ``_load_ranges``) does not fail
            # on a larger object, so core's size must not answer the next lookup.
            self._size_changed(name)
            self.context.count("corrupt_reads_replaced")
            self._throttle.warn(
                "damaged_replaced", "%s: the record of %s read did not verify (%s), but the object "
                "under its name is no longer the one read (%s): a miss, kept",
                self.context.name, printable(key.file_stem()), why, changed,
            )  # fmt: skip
            return
        # Gone: nothing to remove, and a remove could only hit the name another writer
        # has reserved since (its put would then fail).
        code = NOT_FOUND if changed is _GONE else store.remove(name, True)
        if code not in (0, NOT_FOUND):
            # Still in the pool, a miss at every load: not counted as removed.
            self.context.count("corrupt_remove_failures")
            self._throttle.warn(
                "damaged_kept", "%s: %s is not a valid record (%s): a miss, but its removal "
                "returned %s: it stays", self.context.name, printable(key.file_stem()), why, describe(code),
            )  # fmt: skip
            return
        self.context.record_removed(key, accounted)
        self.context.count("corrupt_records_removed")
        outcome = "ok" if code == 0 else "gone already"
        self._throttle.warn(
            "damaged", "%s: %s is not a valid record (%s): a miss, removed (%s)",
            self.context.name, printable(key.file_stem()), why, outcome,
        )  # fmt: skip

    def _replaced_since(
        self, store: Any, name: str, size: int, header: memoryview | bytes | None, payload: memoryview | None
    ) -> str | None:
        """How the object under ``name`` differs now from the ``size`` bytes, ``header``
        and ``payload`` a read judged damaged; None when it still holds them; ``_UNTOLD``
        when it cannot be read to tell (the read failed); ``_GONE`` when there is no
        object."""
        if payload is None:
            return self._header_replaced_since(store, name, size, header)
        # Into memory of its own, not a lane or L1 (Mooncake stages unregistered memory).
        again = bytearray(size)
        view = memoryview(again)
        code = store.get_into(name, address_of(view), size)
        if code == _TOO_SMALL:
            return f"now larger than the {size} bytes read"
        if code == NOT_FOUND:
            return _GONE
        if code < 0:
            return _UNTOLD
        if code != size:
            return f"now {code} bytes, not the {size} read"
        if header is not None and view[:HEADER_BYTES] != header:
            return "another record header"
        if payload is not None and view[HEADER_BYTES:] != payload.cast("B"):
            return "another payload"
        return None

    def _header_replaced_since(
        self, store: Any, name: str, size: int, header: memoryview | bytes | None
    ) -> str | None:
        """:meth:`_replaced_since` for a judgment of the object's size and header alone:
        only those are asked again, never the payload -- read whole, a damaged header a
        lookup found (on the request path) had the whole object transferred into memory
        of its own to compare 4 KiB of it."""
        try:
            now = self._record_sizes(store, [name]).get(name)
        except MooncakeError:
            return _UNTOLD
        if now is None:  # no complete replica: gone, or another writer's put under way
            return _GONE
        if now != size:
            return f"now {now} bytes, not the {size} read"
        if header is None:
            return None
        # A ranged read lands in registered memory only (Mooncake refuses other memory):
        # the judged header's own lane slot -- the key's alone until it is judged -- or,
        # for a copy made once its lane was given back, a lane taken for it.
        if isinstance(header, memoryview):
            return self._header_differs(store, name, header, bytes(header))
        with self.lanes.lane(self.timeout) as lane:
            return self._header_differs(store, name, lane.slot(0), header)

    def _header_differs(self, store: Any, name: str, into: memoryview, judged: bytes) -> str | None:
        """The record header under ``name`` read again into ``into`` (a lane slot) and
        compared with the ``judged`` one, as :meth:`_replaced_since` answers."""
        answer = store.get_into_ranges([address_of(into)], [[name]], [[[0]]], [[[0]]], [[[HEADER_BYTES]]])
        code = answer[0][0][0]  # of the one buffer's one name's one range
        if code == NOT_FOUND:
            return _GONE
        if code != HEADER_BYTES:
            return None  # unreadable now: removed as judged
        return "another record header" if into != judged else None

    # -- delete ----------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Each record's header is read first: another key's intact record and a newer
        format's -- another writer replaced the object under this key's name -- are kept
        (``KeptByDelete``), as lookups keep them; the rest are removed."""
        names = [self.names.of(key) for key in keys]
        removable = self._call_leased("delete", self._deletable, list(keys), names)
        removing = [names[index] for index in removable]
        codes = self._call_leased("delete", _remove, removing) if removing else []
        removed = [False] * len(keys)
        for index, code in zip(removable, codes, strict=True):
            # NOT_FOUND is False too: gone already (Mooncake evicted it, its segment left,
            # another server deleted it); core asks again and releases what it accounts.
            removed[index] = code == 0
            if code not in (0, NOT_FOUND):
                self.context.count("delete_failures")
                self._throttle.warn(
                    "remove", "%s: remove of %s returned %s", self.context.name, names[index], describe(code)
                )
        return removed

    def _deletable(self, store: Any, keys: list[ObjectKey], names: list[str]) -> list[int]:
        """The indexes of the records a delete of ``keys`` removes: not a record another
        writer stored under the name (kept, counted, and read again by the next lookup),
        nor one whose header could not be read (kept: it may be one; counted, logged)."""
        removable: list[int] = []
        for chunk in chunks(len(keys)):
            with self.lanes.lane(self.timeout) as lane:
                codes = _read_headers(store, lane, [names[index] for index in chunk])
                for slot, (index, code) in enumerate(zip(chunk, codes, strict=True)):
                    if code == NOT_FOUND:
                        continue  # gone already: False, and core asks again
                    if code != HEADER_BYTES:
                        self.context.count("delete_header_read_failures")
                        self._throttle.warn(
                            "delete_read", "%s: reading the record header of %s to delete it returned "
                            "%s: not removed", self.context.name, names[index], describe(code),
                        )  # fmt: skip
                    elif self._deletes.keeps(keys[index], lane.slot(slot)):
                        self._reread.add(names[index])
                    else:
                        removable.append(index)
        return removable

    # -- listing ---------------------------------------------------------------------------

    def list_keys(self) -> Iterator[tuple[ObjectKey, int]]:
        if self.config.master_metrics_url is None:
            return iter(())
        return self._listed(
            iter_pool_names(self.config.master_metrics_url, self.config.key_prefix, self.timeout)
        )

    def _listed(self, names: Iterable[str]) -> Iterator[tuple[ObjectKey, int]]:
        batch: list[tuple[ObjectKey, str]] = []
        unreadable = 0
        for name in names:
            key = self.names.key(name)
            if key is None:  # a digest name (accounted when looked up) or not ours
                self.context.count("listing_names_skipped")
                unreadable += 1
                continue
            batch.append((key, name))
            if len(batch) == _LIST_BATCH:
                yield from self._sized(batch)
                batch = []
        if batch:
            yield from self._sized(batch)
        if unreadable:  # e.g. objects of a key_prefix that extends this one ("cache/" and "cache/x/")
            self._throttle.warn(
                "list_unreadable", "%s: %d names under %r are not readable names of this cache's keys "
                "(digest names, accounted when a lookup finds them, or other objects, left alone): "
                "not listed",
                self.context.name, unreadable, self.config.key_prefix,
            )  # fmt: skip

    def _sized(self, batch: list[tuple[ObjectKey, str]]) -> Iterator[tuple[ObjectKey, int]]:
        sizes = self._call_leased("replica query", self._record_sizes, [n for _, n in batch])
        listed = [(key, name) for key, name in batch if sizes.get(name, 0) >= HEADER_BYTES]
        # Names without a size vanished since the master listed them; the rest left out
        # cannot be records (a lookup that finds one removes it as damage).
        short = sum(name in sizes and sizes[name] < HEADER_BYTES for _, name in batch)
        if short:
            self.context.count("listing_names_skipped", short)
            self._throttle.warn(
                "list_short", "%s: %d listed objects are shorter than a record header: not listed",
                self.context.name, short,
            )  # fmt: skip
        unlisted: dict[str, RecordError | None] = {}
        for chunk in chunks(len(listed)):
            part = [listed[i] for i in chunk]
            try:
                unlisted |= self._call_leased("header read", self._kept_records, part)
            except Exception as exc:  # unread: left out, as _kept_records leaves out one it cannot read
                unlisted |= dict.fromkeys((name for _, name in part), None)
                self.context.count("listing_header_read_failures", len(part))
                self._throttle.warn(
                    "list_headers", "%s: reading the record headers of %d listed objects failed: %s; "
                    "not listed (a lookup reads them)", self.context.name, len(part), exc,
                )  # fmt: skip
        foreign = 0
        for name, error in unlisted.items():
            if error is None:
                continue  # unread or gone: counted where found
            if record_verdict(error) is RecordVerdict.FOREIGN:
                foreign += 1
            else:  # a newer server's record: counted as such, and kept
                keeps_unlisted(self.context.name, name, error, self.context.count)
        if foreign:
            self.context.count("listing_names_skipped", foreign)
            self._throttle.warn(
                "list_foreign", "%s: %d listed objects hold records of other keys (a server whose "
                "key_prefix extends %r?): not listed, left alone",
                self.context.name, foreign, self.config.key_prefix,
            )  # fmt: skip
        for key, name in listed:
            if name not in unlisted:
                yield key, sizes[name] - HEADER_BYTES

    def _kept_records(self, store: Any, part: list[tuple[ObjectKey, str]]) -> dict[str, RecordError | None]:
        """Names in ``part`` whose record is kept but not this server's to read, with the
        error that says why: another key than the name says, or a format version this
        code does not read (a newer server sharing the pool wrote it, and reads it) --
        and, with None, the names whose header was not read: gone since they were
        listed, or unreadable now (counted, logged), which may be either kind as well.

        A server whose ``key_prefix`` extends this one's ("cache" and "cache2") names its
        objects exactly as this server names other keys: only their headers tell them
        apart.  Neither kind may be accounted here, where eviction would remove them.
        (The lane is taken and given back on the call's own thread, so a call given up at
        its deadline still holds it until Mooncake is done with it.)

        The keys' records are noted as being read (``reading_records``) until every one
        is judged: a store of a key landing after its header was read -- this call left
        at its deadline, say -- may have replaced that record, and an old one of another
        serde chain must not mark the key a miss over the store's."""
        kept: dict[str, RecordError | None] = {}
        unread = 0
        with self.context.reading_records([key for key, _ in part]), self.lanes.lane(self.timeout) as lane:
            codes = _read_headers(store, lane, [name for _, name in part])
            for slot, ((key, name), code) in enumerate(zip(part, codes, strict=True)):
                if code != HEADER_BYTES:
                    # Gone, or unreadable now: not listed; a lookup that finds it reads
                    # its header and accounts it if it is this server's record.
                    kept[name] = None
                    unread += code != NOT_FOUND
                    continue
                try:
                    self.context.read_record_header(lane.slot(slot), key)
                except RecordError as exc:
                    # Damage is listed: the lookup or load that finds it removes it.  (No
                    # traceback kept: its frames hold the lane's memory.)
                    if record_verdict(exc).kept:
                        kept[name] = exc.with_traceback(None)
        if unread:
            self.context.count("listing_header_read_failures", unread)
            self._throttle.warn(
                "list_unread", "%s: the record headers of %d listed objects could not be read: "
                "not listed (a lookup reads them)", self.context.name, unread,
            )  # fmt: skip
        return kept
