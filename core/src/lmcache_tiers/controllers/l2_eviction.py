"""L2 eviction: one controller per adapter whose config declares ``eviction``.

The adapter reports stores, loads and deletes through an L2 listener (from its own
threads), which feeds the eviction policy under a small lock.  Victims are collected under
that lock in small batches and deleted with the lock released: ``delete`` notifies the
listener, possibly from another thread, and must not wait on a lock this thread holds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from itertools import islice

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import (
    WALK_SLACK,
    AdapterSlot,
    ControllerThread,
    PolicyFailureLog,
    bounded_walk,
    close_walk,
    end_fruitless_walk,
)
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.interface import L2Adapter
from lmcache_tiers.policies import EvictionPolicy

logger = logging.getLogger(__name__)

#: keys deleted per ``delete`` call; bounds how long the policy lock is held
DELETE_BATCH = 64
#: a failed listing of the keys stored before start-up is retried after this long, the
#: interval doubling with each failure up to ``SEED_RETRY_MAX_S`` (a listing that keeps
#: failing would otherwise walk a struggling backend every cycle)
SEED_RETRY_FIRST_S = 1.0
SEED_RETRY_MAX_S = 60.0
#: how long a cycle waits for a listing of the keys stored before start-up; one still
#: running then is left to finish on its own thread (a hung backend may never answer), and
#: eviction goes on meanwhile with the keys the policy hears of from stores
LISTING_DEADLINE_S = 10.0
#: how long a cycle waits for one ``delete`` of a batch of victims; one still running then
#: is left to finish on its own thread (a plain backend's ``delete_many`` is bounded by no
#: ``call_timeout_s``), and cycles are skipped until it ends
DELETE_DEADLINE_S = 30.0
#: keys removed while a listing runs that are remembered (so that it does not add them back
#: when it ends); past that -- a listing that hangs while evictions go on -- they are
#: forgotten, and those it lists are found absent when the policy offers them
REMOVED_WHILE_LISTING_MAX = 1 << 16
#: the event of keys the adapter's start-up scan accounted (``on_l2_keys_scanned``): told
#: to the policy as written, unless it has them from the listing already
SCANNED = "on_keys_scanned"


class L2EvictionController(ControllerThread):
    """Keeps one adapter below its trigger watermark.

    Pinned keys (between a prefetch's lookup and load) are refused by ``delete``; they are
    skipped for the rest of the cycle and offered again in the next one.  So are keys the
    backend failed to delete, counted as ``l2_eviction_delete_failed``; after
    ``DELETE_BATCH`` of those in a row the cycle ends (a backend that is down deletes
    nothing, and would otherwise be asked about every stored key, one by one, each cycle).
    A victim already removed behind the adapter's back (another server sharing the store,
    the store's own eviction) is found gone by the adapter, which releases its bytes and
    reports it deleted, so it leaves the policy like an evicted key.  A victim the policy
    knows from the listing only (stored by another server after the adapter's start-up
    scan) and gone too is reported absent (``on_l2_keys_absent``): it leaves the policy
    as well, freeing nothing, and is not a failed delete.

    The policy learns every key the adapter accounts: stored, adopted by a lookup, or
    accounted by the adapter's start-up scan, which announces its keys
    (``on_l2_keys_scanned``) -- the scan and the seeding list the store apart, and a key
    stored between the two listings would otherwise count in the usage and never be
    evicted.  A key both listings read is written to the policy once.

    While the adapter's circuit breaker is open (its backend down) every delete would be
    refused without reaching the backend: a cycle is skipped instead, counted as
    ``l2_eviction_skipped_circuit_open``, and one that sees the circuit open between two
    batches ends there.  Counted as failed deletes, refusals of deletes never attempted
    would grow by ``DELETE_BATCH`` a cycle for as long as the backend is down.
    """

    def __init__(
        self,
        slot: AdapterSlot,
        policy: EvictionPolicy,
        config: L2EvictionConfig,
        stats: EngineStats,
    ) -> None:
        super().__init__(f"l2-eviction-{slot.index}", interval_s=1.0)
        self.slot = slot
        self.policy = policy
        self.trigger_watermark = config.trigger_watermark
        self.eviction_ratio = config.eviction_ratio
        self.stats = stats
        self._policy_lock = threading.Lock()
        # Until the keys the adapter already held are fed to the policy (oldest first,
        # in the thread: a scan can be slow), listener events wait here in order -- up to
        # the first listing only.  Once a listing failed, events go to the policy as they
        # come (stores go on meanwhile: a queue of them would grow without bound), and
        # the keys they wrote are remembered, so that the listing that finally succeeds
        # adds only keys the policy has not heard of; so are keys removed while that
        # listing runs (it may have listed them before they went).
        self._seeded = False
        self._early_events: list[tuple[str, list[ObjectKey]]] = []
        self._live_unseeded = False
        self._written_unseeded: set[ObjectKey] = set()
        self._listing = False
        self._removed_while_listing: set[ObjectKey] = set()
        self.removed_while_listing_max = REMOVED_WHILE_LISTING_MAX
        # More keys were removed while the running listing ran than are remembered: its
        # result may hold keys gone since, which the policy is told and which the adapter
        # finds absent when they are offered (``on_l2_keys_absent``).
        self._listing_outdated = False
        self._outdated_log = BurstLog(logger, "l2_eviction_listing_removals_forgotten")
        # The keys the seeding listing gave the policy, kept while the adapter's start-up
        # scan still runs: it may announce them again, and a second write would read to
        # the policy as a second use.  Dropped at the first cycle after the scan ended.
        self._listed_while_scanning: set[ObjectKey] | None = None
        self._seed_lock = threading.Lock()  # one listing at a time (the thread, evict())
        # The listing runs on a thread of its own: a backend whose listing never returns
        # must not hold the eviction cycles.  Notified when it ends (and on stop).
        self._listing_done = threading.Condition(self._seed_lock)
        self._listing_thread: threading.Thread | None = None
        self._listing_started_at = 0.0
        self._listing_overdue = False  # the running listing passed its deadline (counted)
        self.listing_deadline_s = LISTING_DEADLINE_S
        self._overdue_log = BurstLog(logger, "l2_eviction_listing_timeout")
        self.seed_retry_first_s = SEED_RETRY_FIRST_S
        self._seed_failures = 0
        self._next_listing_at = 0.0
        self._scan_error_log = BurstLog(logger, "l2_eviction_scan_error")
        # The batch ``evict`` is deleting, and how many of its keys the adapter reported
        # deleted: evicted, or found gone from the store, which frees accounted bytes too;
        # and those it reported absent (gone, never accounted: nothing freed).
        self._batch: frozenset[ObjectKey] = frozenset()
        self._batch_released: set[ObjectKey] = set()
        self._batch_absent: set[ObjectKey] = set()
        self._failed_log = BurstLog(logger, "l2_eviction_delete_failed")
        self._skipped_log = BurstLog(logger, "l2_eviction_skipped_circuit_open")
        self._deferred_log = BurstLog(logger, "l2_eviction_seed_deferred_circuit_open")
        self._policy_log = PolicyFailureLog(logger, "l2_eviction_policy_error")
        self._overrun_log = BurstLog(logger, "l2_eviction_policy_overrun")
        # Keys whose removal the policy failed to take (policy lock): it may still offer
        # them, and a walk's bound must leave room to get past them all.
        self.removals_unreported = 0
        self._evict_lock = threading.Lock()
        # A delete runs on a thread of its own with a deadline: one that never returns must
        # not hold the cycles.  Past it the thread is kept here until it ends; meanwhile no
        # other delete is started (it would pile up behind the hung one), and its keys stay
        # in the policy -- they leave it only when the adapter reports them deleted.
        self.delete_deadline_s = DELETE_DEADLINE_S
        self._delete_done = threading.Condition()
        self._hung_delete: threading.Thread | None = None
        self._hung_delete_log = BurstLog(logger, "l2_eviction_delete_timeout")
        self._skipped_hung_log = BurstLog(logger, "l2_eviction_skipped_delete_hung")
        slot.adapter.add_listener(self)

    # -- L2 listener (adapter threads) ---------------------------------------------------

    def _feed(self, method: str, keys: Sequence[ObjectKey]) -> None:
        with self._policy_lock:
            self._feed_locked(method, keys)

    def _feed_locked(self, method: str, keys: Sequence[ObjectKey]) -> None:
        if not self._seeded and not self._live_unseeded:
            self._early_events.append((method, list(keys)))
            return
        if method == SCANNED:
            method, keys = "on_keys_written", self._not_known_from(self._listed_while_scanning, keys)
            if not keys:
                return
        self._tell_policy(method, keys)
        if not self._seeded:
            self._note_unseeded(method, keys)

    @staticmethod
    def _not_known_from(listed: set[ObjectKey] | None, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """``keys`` (scanned) the policy did not get from the seeding listing ``listed``."""
        return list(keys) if not listed else [key for key in keys if key not in listed]

    def _note_unseeded(self, method: str, keys: Sequence[ObjectKey]) -> None:
        """What the policy heard since a listing failed (policy lock held); bounded by the
        keys stored meanwhile that are still there, as the policy itself is."""
        if method == "on_keys_written":
            self._written_unseeded.update(keys)
        elif method == "on_keys_removed":
            self._written_unseeded.difference_update(keys)
            if self._listing and not self._listing_outdated:
                self._remember_removed_while_listing(keys)

    def _remember_removed_while_listing(self, keys: Sequence[ObjectKey]) -> None:
        """Keys removed while the listing runs (policy lock held), up to a bound: a listing
        that hangs while evictions go on would otherwise keep every key evicted meanwhile.
        Past it they are forgotten (counted): the listing still seeds the policy when it
        ends -- given up, a listing that takes long under steady eviction would never
        seed it, and the keys stored before start-up would never be evicted -- and a key
        it lists that is gone leaves the policy when offered, found absent by the adapter
        (``delete_keys_absent``), not a failed delete."""
        removed = self._removed_while_listing
        removed.update(keys)
        if len(removed) > self.removed_while_listing_max:
            self._listing_outdated = True
            self._removed_while_listing = set()
            self.stats.fail("l2_eviction_listing_removals_forgotten")
            self._outdated_log.event(
                1,
                f"L2 eviction on {self.slot.name}: more than {self.removed_while_listing_max} keys "
                "were removed while the listing of the keys stored before start-up runs; they are "
                "forgotten, and those it lists are found absent when offered for eviction "
                "(delete_keys_absent)",
            )

    def _tell_policy(self, method: str, keys: Sequence[ObjectKey]) -> None:
        """One event to the policy (policy lock held).  A policy that raises is counted and
        the event is lost to it: raised out of ``_seed`` it would leave the policy unseeded
        for good (no eviction, and every event queued in ``_early_events`` forever)."""
        try:
            getattr(self.policy, method)(keys)
        except Exception:
            if method == "on_keys_removed":  # it may keep offering them: room in the walks
                self.removals_unreported += len(keys)
            self._policy_failed()

    def on_l2_keys_stored(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._feed("on_keys_written", keys)
        self.wake()

    def on_l2_keys_scanned(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._feed(SCANNED, keys)
        self.wake()

    def on_l2_keys_loaded(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        self._feed("on_keys_read", keys)

    def on_l2_keys_deleted(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        # One hold of the lock: a batch key another thread reports gone is the policy's
        # news before the eviction thread sees it released (and starts its next walk).
        with self._policy_lock:
            if self._batch:
                self._batch_released.update(key for key in keys if key in self._batch)
            self._feed_locked("on_keys_removed", keys)

    def on_l2_keys_absent(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        # Listed at seeding, never accounted, and now gone from the store: no delete will
        # ever remove them, and offered for good they would count as failed deletes
        # every cycle (and a run of them would end every cycle before it evicts).
        with self._policy_lock:
            if self._batch:
                self._batch_absent.update(key for key in keys if key in self._batch)
            self._feed_locked("on_keys_removed", keys)

    def _seed(self) -> None:
        """Tell the policy about objects stored before this process started.

        Not while the adapter's circuit is open: the listing is not guarded by the circuit
        and would go to the backend known down.  Seeding waits for a cycle after the
        circuit closes; events meanwhile wait in ``_early_events`` (few: the circuit
        refuses every store, load and delete).  A listing that fails (or breaks off
        part-way: nothing of it is used) is retried on a later cycle, after an interval
        that doubles with each failure: left out of the policy, those objects would
        never be evicted, and the adapter could stay above its watermark, refusing
        stores.  A listing that does not end within ``listing_deadline_s`` (a backend
        that hangs rather than fails) is counted and left running on its thread, and
        events go to the policy as they come, as after a failure: eviction goes on with
        the keys stored since; the listing seeds the policy if it ever ends."""
        with self._seed_lock:
            if self._seeded:
                return  # another thread (a direct evict() call) got here first
            if self._listing_thread is None and not self._start_listing():
                return
            if self._listing_overdue:
                return  # counted already: cycles no longer wait for it
            deadline = self._listing_started_at + self.listing_deadline_s
            self._listing_done.wait_for(
                lambda: self._listing_thread is None or self.stopping,
                max(0.0, deadline - time.monotonic()),
            )
            # Another cycle (the thread's, or evict()'s) waiting for the same listing may
            # have reached the deadline first: one hang is counted once.
            if self._listing_thread is not None and not self.stopping and not self._listing_overdue:
                self._listing_past_deadline()

    def _start_listing(self) -> bool:
        """Start a listing on its own thread (seed lock held); False if none was started."""
        if self.slot.adapter.circuit_open:
            self._defer_for_open_circuit()
            return False
        if self._seed_failures and time.monotonic() < self._next_listing_at:
            return False  # the last listing failed: the retry waits its interval
        with self._policy_lock:
            self._listing = True
            self._listing_outdated = False
            self._removed_while_listing.clear()
        thread = threading.Thread(target=self._list, name=f"{self.name}-listing", daemon=True)
        self._listing_thread, self._listing_overdue = thread, False
        self._listing_started_at = time.monotonic()
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: a failed listing, retried later
            self._listing_thread = None
            self._listing_failed(exc)
            return False
        return True

    def _list(self) -> None:
        """The listing thread: the adapter's keys, then the policy seeded with them (or
        the failure counted); whoever waits for it is told."""
        existing: list[ObjectKey] | None = None
        failure: Exception | None = None
        try:
            existing = list(self.slot.adapter.iter_keys())
        except Exception as exc:
            failure = exc
        with self._seed_lock:
            try:
                if self.stopping:
                    self._listing_ended_after_stop(failure)
                elif existing is None:
                    assert failure is not None
                    self._listing_failed(failure)
                else:
                    self._seed_with(existing)
            finally:
                self._listing_thread = None
                self._listing_done.notify_all()
        self.wake()  # a seeded policy may have victims now; a failure, a retry to plan

    def _listing_ended_after_stop(self, failure: Exception | None) -> None:
        """A listing left running at shutdown ended (seed lock held), most often cut short
        by the adapter's close: no retry will follow and no policy will evict again, so it
        is neither a failed listing to count nor a seed to make."""
        logger.info(
            "L2 eviction on %s: the listing left running at shutdown ended%s; not used",
            self.slot.name,
            f" ({failure})" if failure is not None else "",
        )

    def _listing_past_deadline(self) -> None:
        """The listing has not ended by its deadline (seed lock held): counted and logged
        once per listing; events go to the policy from now on, so that eviction goes on
        with the keys it hears of while the listing hangs."""
        self._listing_overdue = True
        self.stats.fail("l2_eviction_listing_timeout")
        self._overdue_log.event(
            1,
            f"L2 eviction on {self.slot.name}: listing the keys stored before start-up has not "
            f"ended in {self.listing_deadline_s:.0f} s (the backend does not answer?); keys "
            "stored since are evicted meanwhile, the listed ones once the listing ends",
        )
        self._go_live()

    def _go_live(self) -> None:
        """Events from now on go to the policy as they come (those queued so far first,
        in order), the keys they write remembered for the listing that succeeds."""
        with self._policy_lock:
            if not self._live_unseeded:
                early, self._early_events = self._early_events, []
                self._live_unseeded = True
                for method, keys in early:
                    self._feed_locked(method, keys)

    def request_stop(self, drain_timeout_s: float = 10.0) -> None:
        super().request_stop(drain_timeout_s)
        with self._seed_lock:  # a cycle waiting for a listing stops waiting
            self._listing_done.notify_all()
        with self._delete_done:  # and one waiting for a delete
            self._delete_done.notify_all()

    def _defer_for_open_circuit(self) -> None:
        self.stats.fail("l2_eviction_seed_deferred_circuit_open")
        self._deferred_log.event(
            1,
            f"L2 eviction on {self.slot.name}: listing the keys stored before start-up "
            "waits for the circuit to close (the backend is down)",
        )

    def _listing_failed(self, exc: Exception) -> None:
        """Counted, logged once per burst, retried later; events from now on go to the
        policy as they come (those queued so far first, in order)."""
        self.stats.fail("l2_eviction_scan_error")
        retry_s = self._schedule_retry()
        self._scan_error_log.warn(
            "listing",
            "%s: listing the keys stored before start-up failed (%s); they are not evicted "
            "until a retry succeeds (next in %.0f s)",
            self.slot.name,
            exc,
            retry_s,
        )
        with self._policy_lock:
            self._listing = False
        self._go_live()

    def _schedule_retry(self) -> float:
        """One more listing that did not seed the policy: the next one waits an interval
        doubling with each (seconds returned)."""
        self._seed_failures += 1
        retry_s = min(SEED_RETRY_MAX_S, self.seed_retry_first_s * 2.0 ** (self._seed_failures - 1))
        self._next_listing_at = time.monotonic() + retry_s
        return retry_s

    def _seed_with(self, existing: list[ObjectKey]) -> None:
        listed = set(existing)
        # Asked before the policy lock: a scan that has ended announced all it accounted
        # already (its events are queued or told), so nothing needs filtering after this.
        scanning = self._adapter_scanning()
        with self._policy_lock:
            if self._live_unseeded:
                # The policy heard every event since the failed listing: only keys it has
                # not heard of join (a second write would reorder or recount a key), and
                # none removed while the listing ran (as far as they are remembered).
                known = self._written_unseeded | self._removed_while_listing
                existing = [key for key in existing if key not in known]
                if existing:
                    self._tell_policy("on_keys_written", existing)
            else:
                if existing:
                    self._tell_policy("on_keys_written", existing)
                for method, keys in self._early_events:
                    if method == SCANNED:  # listed too: written once, with the listing
                        method, keys = "on_keys_written", self._not_known_from(listed, keys)
                    if keys:
                        self._tell_policy(method, keys)
                self._early_events.clear()
            self._listed_while_scanning = listed if scanning else None
            self._seeded = True
            self._live_unseeded = self._listing = self._listing_outdated = False
            self._written_unseeded = set()
            self._removed_while_listing = set()
        if self._seed_failures:
            logger.info(
                "%s: eviction policy seeded with %d stored keys after %d failed listings",
                self.slot.name,
                len(existing),
                self._seed_failures,
            )
        elif existing:
            logger.debug("%s: eviction policy seeded with %d stored keys", self.slot.name, len(existing))

    def _adapter_scanning(self) -> bool:
        """Whether the adapter's start-up scan still runs (and may announce keys).

        An adapter whose ``stats()`` raises cannot tell: it reads as not scanning.  Taken
        as scanning, the kept listing would never be freed and ``stats()`` asked every
        cycle; taken as over, the listing is dropped now and a key the scan announces
        later reaches the policy a second time (its order, never its bytes)."""
        try:
            return bool(self.slot.adapter.stats().get("scan_running"))
        except Exception as exc:
            self.stats.fail("l2_eviction_scan_state_error")
            self._scan_error_log.warn(
                "scan_state",
                "%s: reading the start-up scan's state failed (%s); taken as ended: keys "
                "the scan announces from now on may reach the eviction policy twice",
                self.slot.name,
                exc,
            )
            return False

    def _forget_listing_once_scanned(self) -> None:
        if self._listed_while_scanning is not None and not self._adapter_scanning():
            with self._policy_lock:
                self._listed_while_scanning = None

    # -- the thread ----------------------------------------------------------------------

    def step(self, ready_fds: set[int]) -> None:
        if self.stopping:
            return
        if not self._seeded:
            self._seed()  # at start, before anything could need evicting
        self._forget_listing_once_scanned()
        adapter = self.slot.adapter
        # Stores can fill the adapter far past the watermark between two cycles, and one
        # round of ``eviction_ratio`` may leave it above: rounds go on while they free bytes.
        while not self.stopping:
            usage = adapter.usage()
            if usage < 0 or usage < self.trigger_watermark:
                return  # no capacity to measure against, or below the watermark
            # At least one byte: a round of small objects that rounds down to none would
            # free nothing, and the adapter would refuse stores above its watermark for good.
            with self._evict_lock:  # seeding was tried above: not twice a cycle
                freed = self._evict(max(1, int(adapter.used_bytes() * self.eviction_ratio)), seed=False)
            if freed <= 0:
                return  # nothing left to evict now (pinned, failing): the next cycle retries

    def evict(self, bytes_to_free: int) -> int:
        """Delete victims until ``bytes_to_free`` are freed or none is left; returns freed."""
        with self._evict_lock:  # one at a time: the batch being deleted is shared state
            return self._evict(bytes_to_free)

    def _evict(self, bytes_to_free: int, *, seed: bool = True) -> int:
        if bytes_to_free > 0 and self.slot.adapter.circuit_open:
            self._skip_for_open_circuit()
            return 0
        if seed and not self._seeded:
            self._seed()
        if bytes_to_free > 0 and self._delete_still_hung():
            return 0
        adapter = self.slot.adapter
        start = adapter.used_bytes()
        refused: set[ObjectKey] = set()
        evicted = 0
        released = 0  # keys whose bytes the adapter released: evicted, or found gone
        absent = 0  # keys found gone that it never accounted (nothing to release)
        batch_size = 1  # the interface gives no per-key sizes: learn them from the first delete
        fruitless = 0  # deletes in a row that freed no accounted bytes
        failing = 0  # keys in a row the backend did not delete (refused, not pinned)
        while (
            (freed := start - adapter.used_bytes()) < bytes_to_free
            and fruitless < DELETE_BATCH
            and failing < DELETE_BATCH
            # Stopping: a cycle that shutdown went on without (its delete stuck) must not
            # go on through the adapter closed meanwhile, which refuses every key.
            and not self.stopping
            # Opened meanwhile: the rest of the batches would be refused, not attempted.
            and not self.slot.adapter.circuit_open
        ):
            # (an adapter that does not report its deletes counts its evictions only)
            if (freeing := max(released, evicted)) and freed > 0:
                per_key = freed / freeing
                batch_size = max(1, min(DELETE_BATCH, math.ceil((bytes_to_free - freed) / per_key)))
            elif absent:  # nothing freed yet, and victims that free nothing: go faster
                batch_size = min(DELETE_BATCH, 2 * batch_size)
            with self._policy_lock:
                try:
                    # Bounded: a correct walk reaches ``batch_size`` new keys after the ones
                    # this cycle refused, evicted ones whose removal was not reported yet,
                    # and keys whose removal the policy failed to take.
                    limit = len(refused) + evicted + batch_size + self.removals_unreported + WALK_SLACK
                    with plugin_code():
                        walk = self.policy.victims()
                        try:
                            offered = bounded_walk(walk, limit, self._walk_overran)
                            victims = (key for key in offered if key not in refused)
                            batch = list(dict.fromkeys(islice(victims, batch_size)))
                        finally:
                            close_walk(walk)  # under the policy lock, as plugin code
                except Exception:
                    # A broken policy ends the cycle; what it already evicted is counted.
                    self._policy_failed()
                    batch = []
                    end_fruitless_walk(self.policy, None)
                else:
                    if not batch:  # the walk may have offered keys this cycle refused
                        end_fruitless_walk(self.policy, self._policy_failed)
                self._batch, self._batch_released, self._batch_absent = frozenset(batch), set(), set()
            if not batch:
                break
            before = adapter.used_bytes()
            try:
                deleted = self._delete_with_deadline(batch)
            except Exception as exc:
                self.stats.fail("l2_eviction_delete_error")
                logger.warning("%s: eviction delete failed: %s", self.slot.name, exc)
                break
            finally:
                with self._policy_lock:
                    gone, missing = self._batch_released, self._batch_absent
                    released += len(gone)
                    absent += len(missing)
                    self._batch = frozenset()
                    if not gone and not missing:
                        # The adapter reports removals (on the delete's thread) before
                        # delete returns: none of this batch came.
                        end_fruitless_walk(self.policy, self._policy_failed)
            if deleted is None:
                break  # the delete hangs (counted): its keys stay, nothing more now
            # Deleted keys leave the policy through the listener, and so do keys the
            # adapter found gone from the store; refused ones (pinned, or whose delete
            # failed) are not offered again in this cycle.
            for key, ok in zip(batch, deleted, strict=False):
                if ok:
                    evicted += 1
                else:
                    refused.add(key)
            failed = self._failed_deletes(batch, deleted, gone | missing)
            failing = 0 if any(deleted) or gone or missing else failing + failed
            # Objects the adapter never accounted (left by an earlier process and not yet
            # looked up) free nothing it can measure; bound how many go for nothing.
            fruitless = fruitless + sum(deleted) if adapter.used_bytes() >= before else 0
        freed = start - adapter.used_bytes()
        if evicted:
            self.stats.add_adapter(self.slot.index, "keys_evicted", evicted)
        if evicted or released or absent:
            logger.debug(
                "L2 eviction on %s: %d keys evicted, %d found gone already, %d gone and never "
                "accounted, %d bytes freed",
                self.slot.name,
                evicted,
                max(0, released - evicted),
                absent,
                freed,
            )
        if failing >= DELETE_BATCH:
            logger.debug("L2 eviction on %s stopped: the backend deletes nothing", self.slot.name)
        elif freed < bytes_to_free and self.slot.adapter.circuit_open:
            logger.debug("L2 eviction on %s stopped: the circuit opened", self.slot.name)
        return freed

    def _delete_with_deadline(self, batch: list[ObjectKey]) -> list[bool] | None:
        """``adapter.delete(batch)`` on a thread of its own; None if it has not returned
        within ``delete_deadline_s`` (counted, and no delete starts until it returns) or
        stopping cut the wait short.  Raises what the delete raised."""
        outcome: list[list[bool] | BaseException] = []

        deletes = self.slot.deletes

        def run() -> None:
            try:
                result: list[bool] | BaseException = self.slot.adapter.delete(batch)
            except BaseException as exc:  # handed to the waiting cycle
                result = exc
            finally:
                deletes.end(batch)
            with self._delete_done:
                outcome.append(result)
                self._delete_done.notify_all()
                given_up = self._hung_delete is threading.current_thread()
            if given_up and not isinstance(result, BaseException):
                # The cycle that gave up on it counted none of its keys, and no other
                # cycle will: what it deleted is evicted now.
                evicted = sum(result)
                if evicted:
                    self.stats.add_adapter(self.slot.index, "keys_evicted", evicted)
            # Only a delete its cycle gave up on wakes the next one (skipped while it hung,
            # it may evict now): a cycle that waited goes on by itself, and a wake from
            # every delete ran cycle after cycle of deletes a backend refuses, on an idle
            # server, instead of one a second.
            if given_up:
                self.wake()

        thread = threading.Thread(target=run, name=f"{self.name}-delete", daemon=True)
        # Begun before its thread starts, which a loaded machine may not run before the
        # deadline: past it, ``overdue`` marks only the keys of a delete begun.  A store of
        # one of them meanwhile fails: stored again after.
        deletes.begin(batch)
        try:
            thread.start()
        except BaseException:
            deletes.end(batch)  # no delete runs: the stores waiting for it go on
            raise
        with self._delete_done:
            self._delete_done.wait_for(lambda: bool(outcome) or self.stopping, self.delete_deadline_s)
            if not outcome:
                self._hung_delete = thread
                if not self.stopping:  # shutdown going on without a delete is no hang
                    self._delete_past_deadline(len(batch))
                    deletes.overdue(batch)  # the stores waiting for it give up
                return None
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _delete_past_deadline(self, keys: int) -> None:
        self.stats.fail("l2_eviction_delete_timeout")
        self._hung_delete_log.event(
            1,
            f"L2 eviction on {self.slot.name}: a delete of {keys} victims has not returned in "
            f"{self.delete_deadline_s:.0f} s (the backend does not answer?); they stay accounted "
            "as stored, and eviction waits for that delete to end",
        )

    def _delete_still_hung(self) -> bool:
        """True while a delete left past its deadline still runs: this cycle is skipped,
        counted (a second delete would only pile up behind it)."""
        hung = self._hung_delete
        if hung is None:
            return False
        if not hung.is_alive():
            self._hung_delete = None
            logger.info("L2 eviction on %s: the delete that hung has ended; eviction resumes", self.slot.name)
            return False
        self.stats.fail("l2_eviction_skipped_delete_hung")
        self._skipped_hung_log.event(
            1,
            f"L2 eviction cycles on {self.slot.name} skipped while a delete past its deadline still runs",
        )
        return True

    def _skip_for_open_circuit(self) -> None:
        self.stats.fail("l2_eviction_skipped_circuit_open")
        self._skipped_log.event(
            1,
            f"L2 eviction cycles on {self.slot.name} skipped while the circuit is open (the "
            "backend is down: every delete would be refused without reaching it); eviction "
            "resumes once a probe closes it",
        )

    def _walk_overran(self) -> None:
        self.stats.fail("l2_eviction_policy_overrun")
        self._overrun_log.event(
            1,
            f"L2 eviction policy on {self.slot.name} offered a victim twice in one walk, or past "
            "every key this cycle could take (it offers keys again and again); the walk was cut short",
        )

    def _policy_failed(self) -> None:
        self.stats.fail("l2_eviction_policy_error")
        self._policy_log.failed("%s: eviction policy failed", self.slot.name)

    def _failed_deletes(self, batch: list[ObjectKey], deleted: list[bool], gone: set[ObjectKey]) -> int:
        """How many keys of ``batch`` the backend failed to delete (counted and logged):
        refused by ``delete``, yet neither pinned nor found gone from the store."""
        refused = [key for key, ok in zip(batch, deleted, strict=False) if not ok and key not in gone]
        if not refused:
            return 0
        try:
            pinned = self.slot.adapter.pinned(refused)
        except Exception:  # cannot tell: every refusal counts as a failure
            pinned = [False] * len(refused)
        failed = len(refused) - sum(1 for is_pinned in pinned if is_pinned)
        if failed:
            self.stats.fail("l2_eviction_delete_failed", failed)
            self._failed_log.event(
                failed, f"eviction victims on {self.slot.name} that the backend did not delete"
            )
        return failed
