"""lookup, query/wait_prefetch_status, free_lookup_locks, end_session.

A lookup hashes the request's full chunks, expands each to every worker's object and starts
a prefetch that read-locks the leading objects found (L1, then L2) ``num_kv_readers``
times.  When everything is in L1 the result is known at once; otherwise the lookup waits up
to ``lookup_wait_ms`` on the pool for it, so that the client's first status query (sent at
once by LMCache's bench, once the lookup is answered by vLLM's connector) already has the
answer.  The hit count is delivered once, as in
LMCache; the locks stay with the request until its retrieves consume them, or
``free_lookup_locks`` / ``end_session`` / a newer lookup of the same request gives them back,
or they have been held for half the L1 lock TTL (counted, then released).  A lookup whose
prefetch is still running then is given up (counted): its client is answered 0 hits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lmcache_plugin_lmcache_mp.base import Deferred, RequestRefused, RequestTooLarge, Shared
from lmcache_plugin_lmcache_mp.chunks import first_chunk, full_chunks, keys_for_all_ranks
from lmcache_plugin_lmcache_mp.state import LookupJob, RequestState
from lmcache_plugin_lmcache_mp.wire import CacheKey
from lmcache_tiers.plugin import BurstLog, printable

logger = logging.getLogger(__name__)

#: how long one blocking wait in the pool lasts before it re-checks for shutdown
WAIT_SLICE_S = 0.2
#: read locks a lookup takes per key at most.  ``num_kv_readers`` is the client's choice
#: (LMCache's takes the world size's readers, under 256); billions of locks per key would
#: make L1's read-lock counts meaningless.  Fewer locks than readers is safe: each
#: retrieve read-locks its chunks itself, the lookup's locks only keep them until then.
MAX_KV_READERS = 1024


class Lookups:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.storage = shared.storage
        self._expired = BurstLog(logger, "mp_lookup_locks_expired")
        self._dropped = BurstLog(logger, "mp_request_dropped")
        self._dropped_for_memory = BurstLog(logger, "mp_request_dropped_memory")
        self._abandoned = BurstLog(logger, "mp_lookups_abandoned")
        self._capped = BurstLog(logger, "mp_kv_readers_capped")
        shared.forget_for_memory = self._forgotten_for_memory

    # -- handlers ------------------------------------------------------------------------

    def lookup(self, key: CacheKey, tp_size: int) -> Any:
        shared = self.shared
        now = time.monotonic()
        # As in LMCache, a lookup of a model nobody registered is 0 hits whatever its
        # num_kv_readers; otherwise fewer than 1 is refused before it replaces anything.
        registered = shared.layout_for(key.model_name, key.world_size) is not None
        readers = _readers(key, "lookup") if registered else max(1, key.num_kv_readers)
        state = shared.requests.get(key.request_id, now)
        if state.job is not None:
            self.give_back(state.job)  # a newer lookup replaces it, as in LMCache
            state.job = None
            shared.requests.account(state)
        if not registered:
            logger.debug(
                "lookup of request %s: no instance registered for model %s, world size %d: 0 hits",
                printable(key.request_id),
                printable(key.model_name),
                key.world_size,
            )
            state.job = _settled_empty(key.world_size, readers, now)
            shared.remember(state)  # its id, kept for the status query
            return None
        try:
            chunks = shared.chunks_of(key, ranks=key.world_size, from_zero=True, kept=True)
        except RequestTooLarge as exc:
            # Answered as a lookup of nothing, as a miss is: LMCache's client asks for the
            # result and gets 0 hits, rather than waiting out its timeout.
            shared.refuse_too_large("lookup", key, exc)
            state.job = _settled_empty(key.world_size, readers, now)
            shared.remember(state)  # its id, kept for the status query
            return None
        keys = keys_for_all_ranks(key, chunks)
        if not keys:
            state.job = _settled_empty(key.world_size, readers, now)
            return None
        readers = self._capped_readers(readers)
        handle, locked = self.storage.start_prefetch(keys, readers=readers)
        job = state.job = LookupJob(handle, keys, key.world_size, readers, now, request_id=key.request_id)
        shared.remember(state)  # its keys are kept with the request
        if locked is not None:
            self._settle(job, len(locked))
            return None
        wait_s = shared.config.lookup_wait_ms / 1000.0
        if wait_s <= 0:
            return None
        return self._wait(job, now + wait_s, lambda: None)

    def _capped_readers(self, readers: int) -> int:
        """``readers``, at most :data:`MAX_KV_READERS` (counted and logged when capped)."""
        if readers <= MAX_KV_READERS:
            return readers
        self._count(
            self._capped,
            1,
            f"lookups asked for more than {MAX_KV_READERS} readers (num_kv_readers) and took "
            f"{MAX_KV_READERS} read locks per chunk",
        )
        return MAX_KV_READERS

    def query_prefetch_status(self, request_id: str) -> Any:
        job = self._job(request_id)
        if job is None or job.delivered:
            return 0
        self.absorb(job)
        if job.hits is None:
            return None
        job.delivered = True
        return job.hits

    def wait_prefetch_status(self, request_id: str, timeout: float) -> Any:
        if timeout != timeout:
            # NaN: no deadline is ever reached nor passed, and the wait spun on a pool
            # thread for as long as the prefetch ran.  LMCache's server raises on it.
            raise RequestRefused("mp_bad_request", "wait_prefetch_status with a timeout of NaN")
        job = self._job(request_id)
        if job is None or job.delivered:
            return 0
        self.absorb(job)
        if job.hits is not None:
            job.delivered = True
            return job.hits

        def deliver() -> Any:
            state = self.shared.requests.peek(request_id)
            if state is None or state.job is not job or job.delivered or job.retired:
                return 0  # ended, replaced or collected while we waited
            if job.hits is None:
                return None  # timed out
            job.delivered = True
            return job.hits

        return self._wait(job, time.monotonic() + max(0.0, timeout), deliver)

    def free_lookup_locks(self, key: CacheKey, tp_size: int) -> Any:
        # As in LMCache, num_kv_readers is checked only when there is something to free:
        # an empty range, a request without a lookup or a range past its hits is void.
        chunk_size = self.shared.chunk_size
        first = first_chunk(key, chunk_size)
        last = full_chunks(key, chunk_size)
        if first >= last:
            return None
        job = self._job(key.request_id)
        if job is None:
            logger.debug(
                "free_lookup_locks of request %s without a lookup: nothing held", printable(key.request_id)
            )
            return None
        self.absorb(job)
        if job.hits is None:
            # Released once the prefetch reports.  LMCache answers void here too (it frees
            # nothing while the prefetch runs), also for a key it would refuse to free with.
            if key.num_kv_readers >= 1:
                job.free_early(first, last)
            return None
        keys = job.keys_of_chunks(first, min(last, job.hits))
        if keys:
            _readers(key, "free_lookup_locks")
            self._release(job, job.take(keys))
        return None

    def end_session(self, request_id: str) -> Any:
        state = self.shared.requests.pop(request_id)
        if state is not None and state.job is not None:
            self.give_back(state.job)
        return None

    # -- jobs ----------------------------------------------------------------------------

    def _job(self, request_id: str) -> LookupJob | None:
        state = self.shared.requests.peek(request_id)
        return None if state is None else state.job

    def _wait(self, job: LookupJob, deadline: float, answer: Callable[[], Any]) -> Deferred:
        """Wait on the pool until ``job`` has its result or ``deadline``; then ``answer``.

        The first waiter asks the storage (the result is handed out once); later ones, and
        queries meanwhile, only watch the job's event -- which the loop thread sets too when
        it settles the job, since a later waiter may outlast the first one's wait."""
        owner = not job.waited
        job.waited = True
        storage, stopping = self.storage, self.shared.stopping

        def work() -> Callable[[], Any]:
            while not job.arrived.is_set():
                remaining = deadline - time.monotonic()
                step = max(0.0, min(remaining, WAIT_SLICE_S))
                if owner:
                    hits = storage.wait_prefetch(job.handle, step)
                    if hits is not None:
                        job.arrived_hits = hits
                        job.arrived.set()
                else:
                    job.arrived.wait(step)
                if remaining <= WAIT_SLICE_S or stopping.is_set():
                    break

            def finish() -> Any:
                if owner:
                    job.waited = False
                if job.retired:
                    self.give_back(job)  # replaced or ended meanwhile: nobody will collect it
                else:
                    self.absorb(job)
                return answer()

            return finish

        return Deferred(work)

    def absorb(self, job: LookupJob) -> None:
        """Settle ``job`` if its prefetch has finished (asking the storage unless a pool
        thread is waiting for it)."""
        if job.hits is not None:
            return
        hits = job.arrived_hits
        if hits is None:
            if job.waited or job.handle < 0:
                return
            hits = self.storage.query_prefetch(job.handle)
            if hits is None:
                return
        self._settle(job, hits)

    def _settle(self, job: LookupJob, locked_keys: int) -> None:
        partial = job.settle(locked_keys)
        # Wakes waiters that are not asking the storage: once the first waiter gave up,
        # the sweep's query is what finds the result for them.
        job.arrived.set()
        if partial:
            self.storage.release(partial, job.readers, not_before=self._not_before(job))
        if job.retired:
            self._release(job, job.take(list(job.held)))
            return
        if job.early_frees:
            self._release(job, job.take(job.keys_freed_early()))
            job.early_frees = bytearray()
        self.forget_keys_if_unlocked(job)  # a lookup that hit nothing holds none

    def give_back(self, job: LookupJob) -> int:
        """Release whatever ``job`` holds or will hold; returns the locks released now."""
        job.retired = True
        if job.hits is None:
            self.absorb(job)
        if job.hits is None:
            # Nobody settles a retired job any more (the sweep no longer sees it): waiters
            # watching its event would sit out their whole timeout, which is the client's
            # choice.  Woken, they answer 0, and a waiting owner's finish gives it back.
            job.arrived.set()
            if not job.waited and job.handle >= 0:
                self.storage.discard_prefetch(job.handle)  # its locks go when it finishes
            return 0  # a waiting pool thread settles it, and a retired job gives all back
        return self._release(job, job.take(list(job.held)))

    def current(self, request_id: str) -> LookupJob | None:
        """The request's lookup in force (a retrieve prepared now is that lookup's)."""
        return self._job(request_id)

    def consume(self, job: LookupJob | None, keys: list[Any]) -> None:
        """A retrieve of ``keys`` prepared under lookup ``job`` is done: one of that
        lookup's locks on each goes.  A lookup replaced or ended since holds none (it gave
        them all back), and a newer lookup of the request keeps its own for its retrieve."""
        if job is not None and job.held:
            self._release(job, job.take(keys, 1))

    def _not_before(self, job: LookupJob) -> float:
        """No later than the deadline of any lock ``job``'s prefetch took: ``started`` was
        read before it began.  Releases given it drop the job's own locks, never one
        another holder forgot on the same key (which then expires at its deadline)."""
        return self.storage.l1.lock_deadline(job.started)

    def _release(self, job: LookupJob, groups: dict[int, list[Any]]) -> int:
        released = 0
        if groups:
            not_before = self._not_before(job)
            for count, keys in groups.items():
                self.storage.release(keys, count, not_before=not_before)
                released += count * len(keys)
            self.forget_keys_if_unlocked(job)
        return released

    def forget_keys_if_unlocked(self, job: LookupJob) -> None:
        """Free the keys of a settled lookup that holds no read lock any more (it hit
        nothing, or its retrieves and frees took every lock): they only name the locks to
        give back, and at a large world size they are most of what a request keeps.
        Until then they count against max_remembered_mb; from now on they do not."""
        if job.hits is None or job.held or not job.keys:
            return
        job.keys = []
        state = self.shared.requests.peek(job.request_id)
        if state is not None and state.job is job:
            self.shared.requests.account(state)

    def sweep(self, now: float) -> None:
        """Settle finished prefetches, give back locks held for half the lock TTL, forget
        idle requests."""
        shared = self.shared
        limit = shared.lock_ttl_s / 2
        expired = abandoned = 0
        for state in shared.requests:
            job = state.job
            if job is None:
                continue
            self.absorb(job)
            if now - job.started > limit and (job.held or job.hits is None) and not job.waited:
                # A prefetch still running now never reports to its client: a later status
                # query answers 0 hits (a miss, safe) -- counted, since the client was told
                # nothing of the objects the prefetch may still bring in.
                abandoned += job.hits is None and not job.delivered
                expired += self.give_back(job)
                state.job = None
                shared.requests.account(state)
        idle = shared.requests.idle(now - shared.config.session_ttl_s)
        overflow = shared.requests.overflow()  # after the idle ones: only live requests count
        for state in idle + overflow:
            if state.job is not None:
                expired += self.give_back(state.job)
        # Forgotten while maybe still in use (request ids are the clients' choice, the
        # table is bounded): their next lookup starts from scratch.
        self._count(
            self._dropped,
            len(overflow),
            f"requests forgotten beyond max_requests ({shared.requests.max_requests})",
        )
        self._count(
            self._abandoned,
            abandoned,
            f"lookups whose prefetch ran past {limit:g}s (half the read-lock TTL) were given up: "
            "their requests are answered 0 hits",
        )
        self._count_released(expired)

    def _forgotten_for_memory(self, states: list[RequestState]) -> None:
        """Requests forgotten to keep the total within max_remembered_mb (``Shared.remember``):
        their lookups' locks go back, and both are counted."""
        released = sum(self.give_back(state.job) for state in states if state.job is not None)
        self._count(
            self._dropped_for_memory,
            len(states),
            "requests forgotten, the least recently seen, to keep their tokens, hashes and lookup "
            f"keys within max_remembered_mb ({self.shared.requests.max_bytes >> 20})",
        )
        self._count_released(released)

    def _count_released(self, locks: int) -> None:
        self._count(
            self._expired,
            locks,
            f"read locks of lookups not retrieved or freed within {self.shared.lock_ttl_s / 2:g}s, "
            "or of requests forgotten (idle, beyond max_requests or max_remembered_mb), were released",
        )

    def _count(self, log: BurstLog, count: int, what: str) -> None:
        """``count`` failures of ``log``'s reason, if any: counted and logged."""
        if count:
            self.shared.stats.failure(log.reason or "unspecified", count)
            log.event(count, what)

    def release_everything(self) -> int:
        released = 0
        for state in self.shared.requests:
            if state.job is not None:
                if state.job.arrived_hits is not None:
                    state.job.waited = False  # its waiter will not finish: settle here
                released += self.give_back(state.job)
                state.job = None
                self.shared.requests.account(state)  # its keys are no longer kept
        return released

    def gauges(self) -> tuple[int, int]:
        """(read-locked keys held for lookups, lookups whose result was not delivered)."""
        held = pending = 0
        for state in self.shared.requests:
            if state.job is not None:
                held += len(state.job.held)
                pending += not state.job.delivered
        return held, pending


def _readers(key: CacheKey, operation: str) -> int:
    if key.num_kv_readers < 1:
        raise RequestRefused(
            "mp_bad_request",
            f"{operation} needs num_kv_readers >= 1 (got {key.num_kv_readers}); "
            "LMCache's server refuses it too",
        )
    return key.num_kv_readers


def _settled_empty(world_size: int, readers: int, now: float) -> LookupJob:
    job = LookupJob(-1, [], max(1, world_size), readers, now)
    job.settle(0)
    return job
