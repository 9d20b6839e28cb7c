"""Replay against a StorageManager of this process: the server's engine without its RPC.

The request flow is the native client's -- a prefetch for the lookup, a read-locked
prefix for the retrieve (bytes copied out and checked), both locks released, then a
reserve / copy in / commit of the missing blocks -- so the L1 and L2 see what a server
would, minus the sockets.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from lmcache_tiers.config import ServerConfig
from lmcache_tiers.errors import L1OutOfMemoryError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Object
from lmcache_tiers.registry import ComponentRegistry
from lmcache_tiers.replay.run import (
    ClientState,
    ProgressHook,
    ReplayOptions,
    ReplayReport,
    ReplayStopped,
    block_buffer,
    check_pacing,
    paced,
    signal_of,
    status_delta,
)
from lmcache_tiers.replay.trace import Trace, TraceRequest
from lmcache_tiers.storage import StorageCloseFailed, StorageManager

logger = logging.getLogger(__name__)


class ReplayCloseFailed(TiersError):
    """The replay ran to its end, then the close of its StorageManager failed (each failed
    step already logged and counted by the close; the StorageCloseFailed is the cause).
    ``report`` is the finished replay's: the hit rates are measured and worth showing, and
    the failure is one at the end, not a reason to throw them away."""

    def __init__(self, report: ReplayReport, failure: StorageCloseFailed) -> None:
        super().__init__(f"the replay ran to its end but closing its storage failed: {failure}")
        self.report = report


def _replay_one(
    storage: StorageManager, request: TraceRequest, state: ClientState, scratch: memoryview, timeout_s: float
) -> None:
    totals = state.totals
    blocks = request.hash_ids
    keys = state.keyspace.keys(blocks)
    started = time.perf_counter()
    # No later than the deadline of every lock this request takes (read before the first):
    # its releases drop its own locks, never one another holder forgot on the same key.
    not_before = storage.l1.lock_deadline(time.monotonic())
    handle, locked = storage.start_prefetch(keys)
    if locked is not None:
        hits = len(locked)
    else:
        waited = storage.wait_prefetch(handle, timeout_s)
        if waited is None:
            # Given up on: its read locks are released when it finishes, instead of pinning
            # the prefix (and skewing what is evicted) until the result expires.
            storage.discard_prefetch(handle)
            totals.failed_requests += 1
            totals.count_request(request, 0)
            return
        hits = waited
    totals.lookup_latencies_s.append(time.perf_counter() - started)
    totals.count_request(request, hits)
    if hits:
        objects = storage.read(keys[:hits])
        try:
            retrieved = _copy_out(storage, objects, blocks, state, scratch)
        finally:
            storage.release(keys[: len(objects)], not_before=not_before)  # the retrieve's lock
            storage.release(keys[:hits], not_before=not_before)  # the lookup's lock
        if retrieved < hits:
            totals.short_retrieves += 1
    missing = blocks[hits:]
    if missing:
        _store(storage, keys[hits:], missing, state)


def _store(
    storage: StorageManager, keys: Sequence[ObjectKey], blocks: Sequence[int], state: ClientState
) -> None:
    """Reserve, fill and commit the ``blocks`` not found, as a front end stores them.

    Committed by object, never by key: L1 reaps a reservation at its write TTL (a stalled
    copy), and the key may be another writer's by then, whose bytes are not there yet --
    committing it would make them readable, aborting it would throw its copy away."""
    totals, payloads = state.totals, state.payloads
    try:
        reserved = storage.reserve_write(keys, [payloads.block_bytes] * len(blocks))
    except L1OutOfMemoryError:
        totals.refused_stores += 1
        return
    written: dict[ObjectKey, L1Object] = {}
    try:
        for key, data in zip(keys, payloads.batch(blocks), strict=True):
            target = reserved.get(key)
            if target is None:
                continue
            try:
                storage.write_object(target, data.data)
            except KeyError:
                continue  # reaped before the copy: not ours to fill any more (logged below)
            written[key] = target
    except BaseException:
        storage.abort_reserved(reserved)
        raise
    stored = len(storage.commit_reserved(written))
    totals.stored_blocks += stored
    if stored < len(reserved):
        logger.warning(
            "replay: %d of %d blocks reserved for a store left L1 before their commit "
            "(write TTL passed during the copy): not stored",
            len(reserved) - stored,
            len(reserved),
        )


def _copy_out(
    storage: StorageManager,
    objects: list[L1Object],
    blocks: Sequence[int],
    state: ClientState,
    scratch: memoryview,
) -> int:
    """Copy the read-locked ``objects`` out and check their bytes; how many were copied.

    A copy L1 refuses (KeyError: it cannot vouch for the bytes, e.g. an NVMe write-back
    error since they were written) ends the retrieved prefix there, as the native front
    end's retrieve does: a miss, never a replay ended by a traceback."""
    totals, payloads = state.totals, state.payloads
    for copied, (block, obj) in enumerate(zip(blocks, objects, strict=False)):
        # A persistent L2 may hold an earlier replay's larger blocks under these keys.
        out = scratch[: obj.size] if obj.size <= scratch.nbytes else memoryview(bytearray(obj.size))
        try:
            storage.read_object(obj, out)
        except KeyError as exc:
            logger.warning("replay: retrieve cut short after %d of %d blocks: %s", copied, len(objects), exc)
            return copied
        totals.retrieved_blocks += 1
        totals.retrieved_bytes += obj.size
        if not payloads.matches(block, out):
            totals.corrupt_blocks += 1
    return len(objects)


def replay_in_process(
    config: ServerConfig,
    trace: Trace,
    options: ReplayOptions,
    *,
    registry: ComponentRegistry | None = None,
    progress: ProgressHook | None = None,
) -> ReplayReport:
    """Build a StorageManager from ``config``, replay ``trace`` through it, close it.

    A close that fails after the replay ran to its end raises :class:`ReplayCloseFailed`,
    which carries the report; one that fails after the replay itself raised is left to the
    close's log and counters, the replay's own error raised.  A SIGTERM or Ctrl-C coming
    during the close after the replay ran to its end takes effect once the close is done,
    or at once when a second one comes."""
    check_pacing(trace, options.time_scale)
    state = ClientState.for_options(options)
    scratch = block_buffer(options.block_bytes)
    finished = False
    interrupted: KeyboardInterrupt | SystemExit | None = None
    signals = _SignalsAfterClose()
    try:
        with signals, StorageManager(config, registry) as storage:
            before = storage.status()
            try:
                _replay_all(storage, trace, options, state, scratch, progress)
            except (KeyboardInterrupt, SystemExit) as exc:
                # Ctrl-C or SIGTERM (``signals_unwind``): what was measured is reported once
                # the storage has closed (a second signal meanwhile is ignored).
                interrupted = exc
            after = storage.status()
            finished = interrupted is None
            if finished:
                signals.hold()  # from here on the close runs to its end, whatever signal comes
    except StorageCloseFailed as failed:
        if interrupted is not None:
            raise _stopped(config, options, state, trace, before, after, interrupted, failed) from failed
        if not finished:
            raise
        raise ReplayCloseFailed(_report(config, options, state, before, after), failed) from failed
    except (KeyboardInterrupt, SystemExit) as exc:
        if not finished:
            raise
        # A signal held while the storage of a finished replay closed, handed on once the
        # close ended (or cut short by a second one): every request was measured.
        name, code = signal_of(exc)
        stopped = (
            f"interrupted ({name}) while its storage closed, after all {state.totals.requests:,} requests"
        )
        report = _report(config, options, state, before, after, stopped)
        raise ReplayStopped(f"the replay was {stopped}", report, code) from exc
    if interrupted is not None:
        raise _stopped(config, options, state, trace, before, after, interrupted) from interrupted
    return _report(config, options, state, before, after)


def _stopped(
    config: ServerConfig,
    options: ReplayOptions,
    state: ClientState,
    trace: Trace,
    before: dict[str, Any],
    after: dict[str, Any],
    interrupted: KeyboardInterrupt | SystemExit,
    close_failed: StorageCloseFailed | None = None,
) -> ReplayStopped:
    """The partial report of a replay a signal stopped, as the error that carries it."""
    name, code = signal_of(interrupted)
    stopped = f"interrupted ({name}) after {state.totals.requests:,} of {len(trace.requests):,} requests"
    message = f"the replay was {stopped}"
    if close_failed is not None:
        message += f"; closing its storage failed: {close_failed}"
    return ReplayStopped(message, _report(config, options, state, before, after, stopped), code)


class _SignalsAfterClose:
    """Once :meth:`hold` is called, SIGTERM and Ctrl-C wait until the ``with`` block ends,
    then take effect as their handlers before it say (``signals_unwind``'s: exit 143 or
    130).  For the close of a replay that ran to its end: raised inside the close, a signal
    skipped its steps -- the adapters' close (a last checkpoint), L1's release -- where a
    signal during the replay unwinds into a whole close.  Each step is bounded by its own
    timeout; a second signal, from a user who will not wait for them, hands the held one
    on at once.  In the main thread only (the only one signals reach)."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._caught: int | None = None

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._SIGNALS:
            # One at a time: a signal between the two finds the first one restorable.
            self._previous[sig] = signal.signal(sig, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._caught is None:
            self._caught = signum
            logger.warning(
                "%s came while the replay's storage closes: it closes first, then the replay stops", name
            )
            return
        logger.warning(
            "%s came again while the replay's storage closes: the close is cut short (its L1 arena "
            "may stay in /dev/shm)",
            name,
        )
        self._hand_on()  # raises here, inside the close, what the held signal's handler raises

    def _hand_on(self) -> None:
        """Put the handlers in place before back, then hand them the held signal, once."""
        previous, self._previous = self._previous, {}
        held, self._caught = self._caught, None
        for sig, handler in previous.items():
            # None: a handler not set from Python, which cannot be restored; the default then.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if held is not None:
            signal.raise_signal(held)  # its handler's exception replaces any other

    def __enter__(self) -> _SignalsAfterClose:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hand_on()


def _replay_all(
    storage: StorageManager,
    trace: Trace,
    options: ReplayOptions,
    state: ClientState,
    scratch: memoryview,
    progress: ProgressHook | None,
) -> None:
    """Every request of ``trace``, paced; then the L2 stores still in flight flushed."""
    began = time.perf_counter()
    origin = trace.requests[0].timestamp_ms
    requests = list(enumerate(trace.requests))
    try:
        for _, request in paced(requests, options.time_scale, origin_ms=origin, start=time.monotonic()):
            _replay_one(storage, request, state, scratch, options.timeout_s)
            if progress is not None:
                progress(1)
    finally:
        state.totals.seconds = time.perf_counter() - began  # also of a replay cut short
    storage.flush(timeout=options.timeout_s)  # count the L2 stores still in flight


def _report(
    config: ServerConfig,
    options: ReplayOptions,
    state: ClientState,
    before: dict[str, Any],
    after: dict[str, Any],
    stopped: str | None = None,
) -> ReplayReport:
    where = f"L1 {config.l1_size_bytes} bytes, {len(config.l2_adapters)} L2 adapter(s)"
    return ReplayReport("in-process", where, options, 1, state.totals, status_delta(before, after), stopped)
