"""Replay through a running server with ``lmcache_tiers.client.Client``: real bytes.

Per request: LOOKUP the prompt's blocks (timed), RETRIEVE the hit prefix (checking every
block's bytes) and release it, STORE the missing blocks.  ``clients`` processes share the
requests round robin (request i goes to client i mod N) and pace them on one clock.
L1/L2 hit splits, L2 traffic and evictions come from the server's STATUS counters before
and after, so they include any other client's traffic at the same time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

# the command line's own: a signal before the replay's handlers raises the same
from lmcache_tiers.cli.stop_signals import unwinding
from lmcache_tiers.client import Client, ClientError, RequestTimeoutError, ServerError
from lmcache_tiers.client.connection import CLEANUP_TIMEOUT_S
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.run import (
    ClientState,
    ProgressHook,
    ReplayOptions,
    ReplayReport,
    ReplayStopped,
    ReplayTotals,
    block_buffer,
    check_pacing,
    paced,
    signal_of,
    status_delta,
)
from lmcache_tiers.replay.trace import Trace, TraceRequest
from lmcache_tiers.wire import protocol as p

logger = logging.getLogger(__name__)

#: requests in a row without a reply after which a replay takes its server for gone: each
#: would otherwise wait its whole timeout, for every request left in the trace
UNANSWERED_LIMIT = 3
#: how long client processes of a replay stopped early get to give back what they hold
#: and end on their own before they are killed: the release sent on the way out waits at
#: most the client library's clean-up bound (``CLEANUP_TIMEOUT_S``, rather than the
#: replay's ``--timeout``, 60 s by default), after the client library's own give-back of
#: a STORE or RETRIEVE cut short (as long), and the client's close as long again to settle
#: late replies and see its releases handled, plus a second to unwind and exit
WORKER_GRACE_S = 3 * CLEANUP_TIMEOUT_S + 1.0


def _replay_one(client: Client, request: TraceRequest, state: ClientState) -> None:
    totals, payloads = state.totals, state.payloads
    blocks = request.hash_ids
    keys = state.keyspace.keys(blocks)
    started = time.perf_counter()
    try:
        hits = client.lookup(keys)
    except ClientError:
        totals.count_request(request, 0)  # a request that found nothing, as the engine sees it
        raise
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) once the reply may have come, read-locking a hit
        # prefix whose length never reached us: every key is given back.
        _give_back_lookup_locks(client, keys)
        raise
    totals.lookup_latencies_s.append(time.perf_counter() - started)
    try:
        totals.count_request(request, hits)
        if hits:
            _retrieve_and_check(client, keys[:hits], blocks, state)
    except ClientError:
        raise  # the client library has given this request's locks back already
    except BaseException:
        # Abandoned between LOOKUP and RETRIEVE (Ctrl-C, say): the hit prefix is still
        # read-locked for this client.  Releasing keys no longer locked is harmless.
        _give_back_lookup_locks(client, keys[:hits])
        raise
    missing = blocks[hits:]
    if missing:
        try:
            totals.stored_blocks += client.store(keys[hits:], payloads.batch(missing))
        except ServerError as exc:
            if exc.code != p.ErrorCode.OUT_OF_MEMORY:
                raise
            totals.refused_stores += 1  # L1 full of locked objects: the engine recomputes


def _retrieve_and_check(
    client: Client, keys: Sequence[ObjectKey], blocks: Sequence[int], state: ClientState
) -> None:
    """RETRIEVE the looked-up prefix ``keys`` (which drops the LOOKUP's locks, also on
    failure) and check that every block holds its own bytes."""
    totals, payloads = state.totals, state.payloads
    with client.retrieve(keys) as views:
        retrieved = len(views)
        retrieved_bytes = sum(memoryview(view).nbytes for view in views)
        corrupt = [
            block for block, view in zip(blocks, views, strict=False) if not payloads.matches(block, view)
        ]
    # Counted once the retrieve is over: a StaleReadError on leaving the block says
    # the views' bytes may have changed under them, which voids what was read there.
    totals.retrieved_blocks += retrieved
    totals.retrieved_bytes += retrieved_bytes
    if retrieved < len(keys):
        totals.short_retrieves += 1
    totals.corrupt_blocks += len(corrupt)
    for block in corrupt:
        logger.error("replay: block %d came back with bytes that are not its own", block)


def _give_back_lookup_locks(client: Client, keys: Sequence[ObjectKey]) -> None:
    """Release the hit prefix a LOOKUP read-locked when the request is abandoned before its
    RETRIEVE (Ctrl-C, say), or all its keys when the hits are unknown: left behind, those
    objects stay pinned until the server's lock TTL, long after the replay ended.  Best
    effort: the failure in flight is the one the caller reports."""
    if not keys:
        return
    try:
        # A server that does not answer within the clean-up bound is likely gone: the
        # replay's own timeout would hold up its exit for nothing.
        client.release(keys, timeout=min(client.timeout, CLEANUP_TIMEOUT_S))
    except ClientError as exc:
        logger.warning("replay: could not release %d looked-up blocks: %s", len(keys), exc)


class _CutShort:
    """Set by a signal after the first: the replay's clean-up is not waited for any longer
    where leaving it costs only what a killed replay leaves (locks and reservations to the
    server's TTLs).  Its waits on other processes -- client processes giving back what they
    hold, up to WORKER_GRACE_S, and the server's closing counters -- end at once."""

    def __init__(self) -> None:
        self.armed = False  # in a replay through a server, in its own process (not a client's)
        self.asked = False


_cut_short = _CutShort()


def _ignore_signal(signum: int, frame: Any) -> None:
    """A signal after the first is ignored by a handler of Python's, not by SIG_IGN: one
    that arrived just before the switch (Ctrl-C reaches a client process as the replay
    stops it with SIGTERM) still runs a Python handler, where under SIG_IGN Python printed
    "OSError: Signal 15 ignored due to race condition" with a traceback.  It does not
    raise (an exception there would skip the clean-up that ends client processes), but
    asks the waits that follow not to wait (``_cut_short``): a user who signals again
    does not want to wait seconds more for a server that does not answer."""
    if _cut_short.armed and not _cut_short.asked:
        _cut_short.asked = True
        logger.warning(
            "replay: %s came again: the clean-up is cut short (client processes still giving back "
            "what they hold are killed, the server's counters are not read; what they hold "
            "expires with the server's TTLs)",
            signal.Signals(signum).name,
        )


def _ignore_signals() -> None:
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)


class _SignalDeferral:
    """A signal ``signals_unwind`` caught during a step that must not be cut short (see
    ``signals_deferred``), raised once that step is whole."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.second_cuts = False  # whether a second signal cuts the step short


_deferral = _SignalDeferral()


@contextlib.contextmanager
def signals_unwind(*, then_ignore: bool = False) -> Iterator[None]:
    """SIGTERM raises SystemExit(128 + 15) and SIGINT KeyboardInterrupt where the replay is,
    so that it unwinds, a server replay or an in-process one alike.  Through a server, a
    request stopped after its LOOKUP gives back the read locks it holds, one stopped inside
    a STORE aborts its reservation; in process, the StorageManager closes and removes its
    L1 arena from /dev/shm.  Under Python's default action SIGTERM ended the process at
    once, and those stayed behind.  After the first signal both are ignored, so that no
    second one cuts the clean-up short (except one that cuts short a step
    ``signals_deferred(second_cuts=True)`` held the first for); with ``then_ignore`` they
    stay ignored on the way out (a client process, whose answer must reach the parent
    whole), otherwise the handlers from before are put back.  In the main thread only (the only one signals
    reach).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        if _deferral.depth:
            if _deferral.pending is None:
                _deferral.pending = signum  # raised by signals_deferred once its step is whole
                if not _deferral.second_cuts:
                    _ignore_signals()
                return  # else this handler stays, for a second signal to cut the step short
            logger.warning(
                "replay: %s came again while a step that waits on another process had not "
                "ended: it is cut short (a client process may be left half started)",
                signal.Signals(signum).name,
            )
            signum = _deferral.pending  # the replay stops as the first signal asked (its exit code)
            # A second signal all the same: the clean-up that follows is cut short too.
            _cut_short.asked = _cut_short.asked or _cut_short.armed
        _ignore_signals()
        _deferral.pending = None
        raise unwinding(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        _deferral.pending = None
        for sig, handler in previous.items():
            signal.signal(sig, _ignore_signal if then_ignore else handler)


@contextlib.contextmanager
def signals_deferred(*, second_cuts: bool = False) -> Iterator[None]:
    """Inside ``signals_unwind``: a signal during this step is raised when it ends, not in
    its middle.  For steps that a cut leaves broken: a client process handed half its share
    (it printed a traceback, and no one stopped it), an answer read half off the clients'
    queue (their figures lost).  Only for steps that end on their own, and soon.  With
    ``second_cuts``, for a step that may not end (it waits on another process), a second
    signal cuts it short at once; otherwise later signals are ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _deferral.depth:
        _deferral.second_cuts = second_cuts
    _deferral.depth += 1
    try:
        yield
    finally:
        _deferral.depth -= 1
        if not _deferral.depth and _deferral.pending is not None:
            _ignore_signals()  # no second one cuts the clean-up short
            signum, _deferral.pending = _deferral.pending, None
            raise unwinding(signum)


def replay_share(
    url: str,
    requests: Sequence[tuple[int, TraceRequest]],
    options: ReplayOptions,
    *,
    origin_ms: float,
    start: float,
    auth_token: str | None = None,
    progress: ProgressHook | None = None,
    totals: ReplayTotals | None = None,
) -> ReplayTotals:
    """One client's share of the trace; ``progress(n)`` after every n requests.  Counted
    into ``totals`` when given, which then hold what was measured also when the share
    ends early (an exception: the server stopped answering, Ctrl-C, SIGTERM)."""
    state = ClientState.for_options(options)
    if totals is not None:
        state.totals = totals
    try:
        _replay_requests(url, requests, options, state, origin_ms, start, auth_token, progress)
    finally:
        # From the start all clients share (the first request is due then), so that the
        # slowest client's figure, which the merge keeps, is the replay's wall time.
        state.totals.seconds = max(0.0, time.monotonic() - start)
    return state.totals


def _replay_requests(
    url: str,
    requests: Sequence[tuple[int, TraceRequest]],
    options: ReplayOptions,
    state: ClientState,
    origin_ms: float,
    start: float,
    auth_token: str | None,
    progress: ProgressHook | None,
) -> None:
    totals = state.totals
    unanswered = 0
    with Client(url, timeout=options.timeout_s, auth_token=auth_token, name="replay") as client:
        for _, request in paced(requests, options.time_scale, origin_ms=origin_ms, start=start):
            try:
                _replay_one(client, request, state)
                unanswered = 0
            except ClientError as exc:
                totals.failed_requests += 1
                logger.warning("replay: request failed: %s", exc)
                unanswered = unanswered + 1 if isinstance(exc, RequestTimeoutError) else 0
                if unanswered >= UNANSWERED_LIMIT:
                    raise ClientError(
                        f"the server stopped answering: {unanswered} requests in a row got no reply "
                        f"(last: {exc})"
                    ) from None
            if progress is not None:
                progress(1)


def _worker(
    url: str,
    requests: list[tuple[int, TraceRequest]],
    options: ReplayOptions,
    origin_ms: float,
    start: float,
    auth_token: str | None,
    counter: Any,
    results: Any,
) -> None:
    def bump(count: int) -> None:
        with counter.get_lock():
            counter.value += count

    # A replay killed outright (SIGKILL) cannot tell its clients: they would replay on,
    # orphans, to the end of their share.  They end with it instead.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with, args=(parent,), name="replay-parent", daemon=True).start()
    totals = ReplayTotals()
    try:
        # The parent stops a client with SIGTERM: it unwinds, giving back what it holds.
        # Signals stay ignored after the share: one killing the process while its answer
        # is written would lose its figures and leave the parent half a message to read.
        with signals_unwind(then_ignore=True):
            replay_share(
                url,
                requests,
                options,
                origin_ms=origin_ms,
                start=start,
                auth_token=auth_token,
                progress=bump,
                totals=totals,
            )
        results.put(("ok", totals))
    except BaseException as exc:  # the parent reports it; a worker must always answer
        # with what it measured until then, which the parent's partial report adds up
        results.put(("error", (_explained(exc), totals)))


def _explained(exc: BaseException) -> str:
    """A worker's failure as the parent's error line shows it: the client's own errors
    by their message, as one client's are; anything else (a bug) by its type too."""
    if isinstance(exc, ClientError) and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _end_with(parent: Any) -> None:
    parent.join()  # returns once the parent process is gone
    # Unwound like a client the parent stopped (its locks given back), and ended outright
    # if that does not finish within the time allowed for it.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(WORKER_GRACE_S)
    os._exit(1)


def replay_server(
    url: str,
    trace: Trace,
    options: ReplayOptions,
    *,
    clients: int = 1,
    auth_token: str | None = None,
    progress: ProgressHook | None = None,
) -> ReplayReport:
    """Replay ``trace`` against the server at ``url``; ClientError if it cannot be reached,
    ConfigError before any request for a schedule or a block size it cannot replay.

    A replay that starts and then ends early -- the server stops answering, Ctrl-C,
    SIGTERM -- or whose server does not give its counters after the last request raises
    :class:`ReplayStopped`, which carries the report of what was measured."""
    if clients < 1:
        raise ValueError("clients must be at least 1")
    check_pacing(trace, options.time_scale)
    block_buffer(options.block_bytes)  # before any client: its first store allocates several
    _cut_short.armed, _cut_short.asked = True, False
    try:
        with signals_unwind():
            return _replay_server(url, trace, options, clients, auth_token, progress)
    finally:
        _cut_short.armed = False


def _replay_server(
    url: str,
    trace: Trace,
    options: ReplayOptions,
    clients: int,
    auth_token: str | None,
    progress: ProgressHook | None,
) -> ReplayReport:
    with Client(url, timeout=options.timeout_s, auth_token=auth_token, name="replay-status") as probe:
        before = probe.status()
        before_read = time.monotonic()  # the server counted it before this (see _restart_between)
    totals = ReplayTotals()

    def report(after: dict[str, Any] | None, stopped: str | None = None) -> ReplayReport:
        server = None if after is None else status_delta(before, after)
        return ReplayReport("server", url, options, clients, totals, server, stopped)

    def measured() -> str:
        return f"after {totals.requests:,} of {len(trace.requests):,} requests"

    failure: ClientError | None = None
    interrupted: KeyboardInterrupt | SystemExit | None = None
    try:
        _replay_all(url, trace, options, clients, auth_token, progress, totals)
    except ClientError as exc:
        failure = exc  # the server stopped answering, or a client process failed
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted = exc
    # Cut short, the last STATUS gets the clean-up bound only: the user asked to stop (a
    # second signal is ignored meanwhile), or the server may be gone (it may answer again).
    ran_to_end = failure is None and interrupted is None
    wait_s = options.timeout_s if ran_to_end else min(options.timeout_s, CLEANUP_TIMEOUT_S)
    after: dict[str, Any] | None = None
    unread: str | None = "a second signal asked not to wait for them"
    late_signal: KeyboardInterrupt | SystemExit | None = None
    if not _cut_short.asked:
        asked_at = time.monotonic()
        after, unread, late_signal = _counters_after(url, auth_token, wait_s)
        restart = None if after is None else _restart_between(before, after, asked_at - before_read)
        if restart is not None:
            # The client follows a server restarted at its address, so the replay went on;
            # the difference of two processes' counters is none of its figures (negative
            # after a busy first life, short otherwise).
            after, unread = None, restart
    if failure is not None:
        logger.warning("replay: ended early %s: %s", measured(), failure)
        raise ReplayStopped(
            f"replay through {url} failed: {failure}", report(after, f"{failure} ({measured()})"), 1
        ) from failure
    signalled = interrupted if interrupted is not None else late_signal
    if signalled is not None:
        name, code = signal_of(signalled)
        stopped = f"interrupted ({name}) {measured()}"
        if interrupted is None:
            stopped += ", as the server's L2 stores settled: its L2 counts may be short"
        if unread is not None:
            stopped += f"; the server's counters could not be read: {unread}"
        raise ReplayStopped(f"the replay was {stopped}", report(after, stopped), code) from signalled
    if unread is not None:
        stopped = f"the server's counters could not be read after the last request: {unread}"
        logger.warning("replay: %s", stopped)
        raise ReplayStopped(
            f"the replay ran its {totals.requests:,} requests but the server's counters could not be "
            f"read: {unread}",
            report(None, stopped),
            1,
        )
    return report(after)


#: how far a server's uptime may fall behind this process's clock between two STATUS
#: replies of one server process: the two clocks' rates differ by a few hundred ppm at most
RESTART_SLACK_S = 1.0
RESTART_SLACK_RATE = 0.002


def _restart_between(before: dict[str, Any], after: dict[str, Any], elapsed_s: float) -> str | None:
    """Why ``after`` is the STATUS of another server process than ``before`` (the server
    restarted during the replay), or None.  ``elapsed_s`` passed between the two replies at
    least, so the uptime of one process grew at least that much; a new process (the same
    pid in a container) started after the first reply, so its uptime grew less by the old
    one's uptime then."""
    old, new = before.get("server", {}), after.get("server", {})
    if old.get("pid") != new.get("pid"):
        return f"the server restarted during the replay (pid {old.get('pid')}, then {new.get('pid')})"
    old_up, new_up = old.get("uptime_s"), new.get("uptime_s")
    if not isinstance(old_up, (int, float)) or not isinstance(new_up, (int, float)):
        return None
    if new_up - old_up < elapsed_s - (RESTART_SLACK_S + RESTART_SLACK_RATE * elapsed_s):
        return (
            f"the server restarted during the replay (up {old_up:.1f} s at its start, "
            f"{new_up:.1f} s at its end, {elapsed_s:.1f} s later)"
        )
    return None


def _counters_after(
    url: str, auth_token: str | None, timeout_s: float
) -> tuple[dict[str, Any] | None, str | None, KeyboardInterrupt | SystemExit | None]:
    """The closing STATUS (``_closing_status``), and the signal that cut its wait short, if
    one did: SIGTERM or Ctrl-C while the server's L2 stores settle (up to --timeout) lost
    the report of a replay that had measured every request.  The counters are then read
    again at once, within the clean-up bound (a second signal is ignored by then)."""
    try:
        return (*_closing_status(url, auth_token, timeout_s), None)
    except (KeyboardInterrupt, SystemExit) as exc:
        return (*_closing_status(url, auth_token, min(timeout_s, CLEANUP_TIMEOUT_S)), exc)


def _replay_all(
    url: str,
    trace: Trace,
    options: ReplayOptions,
    clients: int,
    auth_token: str | None,
    progress: ProgressHook | None,
    totals: ReplayTotals,
) -> None:
    """Every request of ``trace``, by ``clients`` clients, counted into ``totals``."""
    indexed = list(enumerate(trace.requests))
    origin = trace.requests[0].timestamp_ms
    if clients == 1:
        replay_share(
            url,
            indexed,
            options,
            origin_ms=origin,
            start=time.monotonic(),
            auth_token=auth_token,
            progress=progress,
            totals=totals,
        )
    else:
        _replay_in_processes(url, indexed, options, clients, origin, auth_token, progress, totals)


def _closing_status(
    url: str, auth_token: str | None, timeout_s: float
) -> tuple[dict[str, Any] | None, str | None]:
    """The server's STATUS once its L2 stores settled, or None and why it could not be read."""
    try:
        with Client(url, timeout=timeout_s, auth_token=auth_token, shm=False, name="replay-status") as probe:
            return _settled_status(probe, timeout_s), None
    except ClientError as exc:
        return None, str(exc)


def _settled_status(probe: Client, timeout_s: float) -> dict[str, Any]:
    """STATUS once the server's L2 stores have settled (or ``timeout_s`` has passed).

    A STORE is acknowledged before its L2 store runs: taken at once, the counters would
    leave out the last batches the replay stored (the in-process replay flushes instead).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        status = probe.status()
        store = status.get("store", {})
        if not store.get("in_flight_tasks") and not store.get("pending_batches"):
            return status
        if time.monotonic() >= deadline:
            logger.warning(
                "replay: the server's L2 stores did not settle within %g s; L2 counts may be short",
                timeout_s,
            )
            return status
        time.sleep(0.02)


def _replay_in_processes(
    url: str,
    indexed: list[tuple[int, TraceRequest]],
    options: ReplayOptions,
    clients: int,
    origin: float,
    auth_token: str | None,
    progress: ProgressHook | None,
    totals: ReplayTotals,
) -> None:
    """The requests shared by ``clients`` processes; what each measured is merged into
    ``totals``, also that of a client stopped early."""
    context = multiprocessing.get_context("spawn")  # no inherited sockets or locks
    counter = context.Value("q", 0)
    results = context.Queue()
    # Spawning takes a while: start the clock a little ahead so every client is up.
    start = time.monotonic() + 2.0
    workers = [
        context.Process(
            target=_worker,
            args=(url, indexed[share::clients], options, origin, start, auth_token, counter, results),
            name=f"replay-client-{share}",
            daemon=True,
        )
        for share in range(clients)
    ]
    started: list[multiprocessing.context.SpawnProcess] = []
    errors: list[str] = []
    reported = 0
    answers = 0

    def take(status: str, payload: Any) -> None:
        nonlocal answers
        if status == "ok":
            totals.merge(payload)
        else:
            message, partial = payload
            errors.append(message)
            totals.merge(partial)
        answers += 1

    try:
        # A signal while a client process is handed its share waits until they all have
        # theirs; then they are stopped like any other.  A second one does not wait: a
        # client that never reads its share (hung as it starts) would block the hand-over
        # for ever.
        with signals_deferred(second_cuts=True):
            for worker in workers:
                worker.start()
                started.append(worker)
        while answers < clients:
            with signals_deferred():  # an answer is read whole and counted, or not at all
                try:
                    status, payload = results.get(timeout=0.2)
                except queue.Empty:  # keep the progress moving
                    status = None
                if status is not None:
                    take(status, payload)
            if status is None and not any(worker.is_alive() for worker in workers) and results.empty():
                errors.append("a replay client process died without a result")
                break
            done = counter.value
            if progress is not None and done > reported:
                progress(done - reported)
                reported = done
    finally:
        if answers < clients:
            # Stopped early (Ctrl-C, SIGTERM, an error): what the clients still do is not
            # wanted.  SIGTERM makes each give back what it holds and end (one that Ctrl-C
            # reached too is doing so already, and ignores it); one that does not end
            # within the grace is killed below.
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
            grace = time.monotonic() + WORKER_GRACE_S
            # Their answers, read as they come (a client's exit waits for its answer to be
            # read off the pipe), add what each measured to the partial report.
            while answers < clients and time.monotonic() < grace and not _cut_short.asked:
                try:
                    take(*results.get(timeout=0.1))
                except queue.Empty:
                    if not any(worker.is_alive() for worker in workers):
                        break
            for worker in started:
                if not _cut_short.asked:
                    worker.join(timeout=max(0.0, grace - time.monotonic()))
                if worker.is_alive():
                    worker.kill()
            if answers < clients:
                logger.warning(
                    "replay: %d of %d client processes ended without their figures: their requests "
                    "are not in the report",
                    clients - answers,
                    clients,
                )
        for worker in started:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    if errors:
        raise ClientError(f"{len(errors)} of {clients} replay clients failed: {errors[0]}")
