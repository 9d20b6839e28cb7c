"""L1 eviction: keep the arena below the trigger watermark.

The eviction policy is fed through an L1 listener.  Listeners run inside the L1 lock, and
victims are consumed inside it too (``evict_now``), so the L1 lock is the one lock that
serialises every call into the policy, whichever thread writes, reads or evicts.

Objects whose L2 store has not happened yet are acknowledged writes that exist nowhere
else: the watermark pass never evicts them (it only makes headroom), and a write that needs
room takes them only when nothing else frees enough -- counted as
``evicted_before_l2_store`` and logged once per burst.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers.base import (
    WALK_SLACK,
    ControllerThread,
    PolicyFailureLog,
    bounded_walk,
    close_walk,
    end_fruitless_walk,
)
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import plugin_code, plugin_walk
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.policies import EvictionPolicy
from lmcache_tiers.sweep_cadence import SWEEP_FLOOR_S, next_sweep_at, sweep_interval

logger = logging.getLogger(__name__)

#: the longest between two reaps of expired L1 locks, whatever the TTLs: a lock past a long
#: TTL lives at most this much longer
MAX_REAP_INTERVAL_S = 5.0


class _PolicyFeed:
    """L1 listener that forwards changes to the policy and wakes the controller."""

    def __init__(self, controller: L1EvictionController) -> None:
        self._controller = controller

    # A policy that raises is counted here: the L1 table would only log it, and a write
    # that crossed the watermark would not wake the controller.

    def on_l1_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        controller = self._controller
        try:
            with plugin_code():
                controller.policy.on_keys_written(keys)
        except Exception:
            controller._policy_failed()
        if controller.l1.usage() >= controller.trigger_watermark:
            controller.wake()

    def on_l1_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        # Every lookup's hits come here: a plain ``try`` costs nothing until the policy
        # raises, where entering and leaving plugin_code() took a third of this call.
        # What it raised is judged by plugin_code() then, as if raised inside it.
        try:
            self._controller.policy.on_keys_read(keys)
        except BaseException:
            try:
                with plugin_code():
                    raise
            except Exception:
                self._controller._policy_failed()

    def on_l1_keys_deleted(self, keys: Sequence[ObjectKey]) -> None:
        try:
            with plugin_code():
                self._controller.policy.on_keys_removed(keys)
        except Exception:
            # The policy may keep these keys: its walks may offer them (L1 skips them,
            # counted as l1_eviction_policy_unknown_victim).
            self._controller.removals_unreported += len(keys)
            self._controller._policy_failed()


class L1EvictionController(ControllerThread):
    """When usage reaches the watermark, evict ``eviction_ratio`` of the allocated bytes,
    round after round until usage is below it.

    Locked objects (being written, read, or loaded by a prefetch) are never evicted: the
    L1 manager skips them and the policy's next victim is tried.  The thread also reaps
    lock TTLs, so a crashed client cannot pin memory forever: every ``reap_interval_s``,
    by default a quarter of L1's shortest TTL (lock, write, lease grace) within
    ``SWEEP_FLOOR_S`` and :data:`MAX_REAP_INTERVAL_S` (``sweep_cadence.py``), so that an
    expired lock holds its L1 space, and ``l1_lock_expired`` counts it, at most that late;
    a reap that takes longer than a twentieth of that (very many locks) is spaced out by
    its own cost, so that it holds the L1 lock at most 5 % of the time.
    """

    def __init__(
        self,
        l1: L1Manager,
        policy: EvictionPolicy,
        *,
        trigger_watermark: float,
        eviction_ratio: float,
        stats: EngineStats,
        reap_interval_s: float | None = None,
    ) -> None:
        super().__init__("l1-eviction", interval_s=1.0)
        self.l1 = l1
        self.policy = policy
        self.trigger_watermark = trigger_watermark
        self.eviction_ratio = eviction_ratio
        self.stats = stats
        if reap_interval_s is None:
            reap_interval_s = sweep_interval(
                (l1.lock_ttl_s, l1.write_ttl_s, l1.lease_grace_s), ceiling=MAX_REAP_INTERVAL_S
            )
        self.reap_interval_s = reap_interval_s
        self._next_reap = time.monotonic() + reap_interval_s
        self._feed = _PolicyFeed(self)
        self._lost_writes = BurstLog(logger, "evicted_before_l2_store", level=logging.ERROR)
        # A broken policy fails on every write, read and delete (under the L1 lock): one
        # traceback, then one line per burst; the counter has every failure.
        self._policy_log = PolicyFailureLog(logger, "l1_eviction_policy_error")
        self._overrun_log = BurstLog(logger, "l1_eviction_policy_overrun")
        self._unknown_log = BurstLog(logger, "l1_eviction_policy_unknown_victim")
        # Stuck above the watermark, every write's wake-up runs a fruitless round.
        self._stuck_log = BurstLog(logger, "l1_nothing_evictable")
        # Keys whose removal the policy failed to take (under the L1 lock): it may still
        # offer them, and a walk's bound must leave room to get past them all.
        self.removals_unreported = 0
        # A policy with both optional hooks leaves the locked keys a walk passed over out of
        # its walks until their locks end (``EvictionPolicy``): a full L1 whose policy puts
        # locked objects first then walks past each once, not on every write.
        set_aside, put_back = getattr(policy, "set_aside", None), getattr(policy, "put_back", None)
        self._sets_aside = callable(set_aside) and callable(put_back)
        # Keys whose locks ended but whose ``put_back`` raised: the policy may still hold
        # them aside, and L1 has forgotten them.  Given back again before every walk until
        # a put_back takes them (or they leave L1), else their objects would never be
        # offered again and L1 would fill with objects nothing evicts.
        self._put_back_failed: list[ObjectKey] = []
        l1.add_listener(self._feed)

    def evict_now(self, bytes_to_free: int, *, spare_unstored: bool = False) -> int:
        """Evict synchronously (any thread); returns the aligned bytes actually freed.

        Objects not yet stored in L2 go last, and never with ``spare_unstored`` (room for
        a prefetch, or headroom, is not worth an acknowledged write).
        """
        return self._evict(bytes_to_free, spare_unstored)[0]

    def _evict(self, bytes_to_free: int, spare_unstored: bool) -> tuple[int, int]:
        """``evict_now``: the bytes freed, and how many objects were evicted.  The two
        differ in kind: an object whose extent is held back for an expired lock's grace
        period leaves L1 and frees nothing until that period ends."""
        if bytes_to_free <= 0:
            return 0, 0
        with self.l1.lock:
            self._put_back_unlocked()
            before, objects = self.l1.used_bytes, len(self.l1)
            walk: Iterator[ObjectKey] | None = None
            passed_locked: list[ObjectKey] | None = [] if self._sets_aside else None
            unknown: list[ObjectKey] = []
            try:
                # victims() is created inside the L1 lock: no listener can touch the
                # policy while its iterator is alive.
                # Bounded: the policy holds no key L1 does not but those whose removal it
                # failed to take, so a walk past them all is one offering keys again (see
                # ``bounded_walk``).
                limit = objects + self.removals_unreported + WALK_SLACK
                with plugin_code():
                    walk = self.policy.victims()
                victims = bounded_walk(plugin_walk(walk), limit, self._walk_overran)
                eviction = self.l1.make_room(
                    bytes_to_free,
                    victims,
                    spare_unstored=spare_unstored,
                    passed_locked=passed_locked,
                    unknown=unknown,
                )
            except Exception:
                # A broken policy must not fail the write or prefetch that needed room.  The
                # victims it offered before failing are evicted all the same: count them.
                self._policy_failed()
                self._close_walk(walk)
                freed = before - self.l1.used_bytes
                evicted = objects - len(self.l1)
                if not evicted:
                    end_fruitless_walk(self.policy, None)
                self._count_evicted(evicted, freed)
                self._count_unknown(unknown)
                return freed, evicted
            # Cut short once the room is made; its eviction stands if its cleanup fails.
            self._close_walk(walk)
            if not eviction.keys:
                end_fruitless_walk(self.policy, self._policy_failed)
            if passed_locked:
                self._set_aside(passed_locked)
            freed = before - self.l1.used_bytes
        self._count_evicted(len(eviction.keys), freed)
        self._count_unknown(unknown)
        if eviction.unstored:
            self.stats.fail("evicted_before_l2_store", len(eviction.unstored))
            self._lost_writes.event(
                len(eviction.unstored),
                "L1 objects evicted before their L2 store: every other object was locked or too "
                "small to make room for a write (L2 stores are slower than the writes)",
            )
        return freed, len(eviction.keys)

    def _set_aside(self, keys: list[ObjectKey]) -> None:
        """Ask the policy, its walk over, to leave out of its walks the locked ``keys`` the
        walk passed over.  L1 remembers them whether or not the policy raises: a policy
        that still offers them is only walked past them again, and each is put back (a
        key it does not hold aside is ignored) once its lock ends."""
        try:
            with plugin_code():
                self.policy.set_aside(keys)  # type: ignore[attr-defined]
        except Exception:
            self._policy_failed()

    def _put_back_unlocked(self) -> None:
        """Give the policy back the keys set aside whose locks have ended, before it walks:
        they are evictable again, in its order.  Those of a put_back that raised are given
        again each time until one takes them (``put_back`` ignores keys it does not hold
        aside).  The caller holds the L1 lock."""
        if not self._sets_aside:
            return
        keys = self.l1.take_unlocked_set_aside()
        if self._put_back_failed:
            keys = list(dict.fromkeys([*self._put_back_failed, *keys]))
            self._put_back_failed = []
        if not keys:
            return
        try:
            with plugin_code():
                self.policy.put_back(keys)  # type: ignore[attr-defined]
        except Exception:
            # Keys that left L1 were reported removed: the policy holds them no more.
            self._put_back_failed = [key for key in keys if self.l1.contains(key)]
            self._policy_failed()

    def _close_walk(self, walk: Iterator[ObjectKey] | None) -> None:
        """Close the policy's walk under the L1 lock, as plugin code (``close_walk``); a
        cleanup that raises is the policy's counted failure.  A walk that failed is over
        already: closing it runs nothing, so its failure is not counted twice."""
        if walk is None:
            return
        try:
            with plugin_code():
                close_walk(walk)
        except Exception:
            self._policy_failed()

    def _policy_failed(self) -> None:
        self.stats.fail("l1_eviction_policy_error")
        self._policy_log.failed("L1 eviction policy failed")

    def _count_unknown(self, unknown: list[ObjectKey]) -> None:
        """Count and log the victims a walk offered that L1 holds no stored object of."""
        if not unknown:
            return
        self.stats.fail("l1_eviction_policy_unknown_victim", len(unknown))
        self._unknown_log.event(
            len(unknown),
            "victims the L1 eviction policy offered that L1 holds no stored object of (not "
            "held, or a reservation being written) were skipped: the policy holds keys it "
            "was told were removed, or never heard of",
        )

    def _walk_overran(self) -> None:
        self.stats.fail("l1_eviction_policy_overrun")
        self._overrun_log.event(
            1,
            "L1 eviction policy offered a victim twice in one walk, or more than L1 holds objects "
            "(it offers keys again and again); the walk was cut short",
        )

    def _nothing_evictable(self) -> None:
        self.stats.fail("l1_nothing_evictable")
        self._stuck_log.warn(
            "l1_nothing_evictable",
            "L1 eviction round evicted nothing at %.0f%% usage, %d objects (failure reason "
            "l1_nothing_evictable): every object is locked (being written, read or loaded by a "
            "prefetch) or waits for its L2 store, or the eviction policy offers none; writes that "
            "need room fail with OUT_OF_MEMORY until some frees up. Give L1 more room or L2 more "
            "store throughput, or have clients release the objects their lookups lock",
            self.l1.usage() * 100,
            len(self.l1),
        )

    def _count_evicted(self, keys: int, freed: int) -> None:
        if keys:
            self.stats.add("l1_evicted_keys", keys)
            self.stats.add("l1_evicted_bytes", freed)
            self.stats.add("l1_eviction_runs")
            logger.debug("L1 eviction: %d objects, %d bytes freed", keys, freed)

    def above_watermark(self) -> bool:
        return self.l1.usage() >= self.trigger_watermark

    def step(self, ready_fds: set[int]) -> None:
        # A burst of writes can fill the arena far past the watermark before this thread
        # runs, and one round of ``eviction_ratio`` may leave it above: rounds go on.
        while self.above_watermark():
            # At least one byte: a round that rounds down to none would free nothing, and
            # read as nothing evictable, while the arena stays above the watermark.
            round_bytes = max(1, int(self.l1.used_bytes * self.eviction_ratio))
            freed, evicted = self._evict(round_bytes, spare_unstored=True)
            if freed == 0:
                # Everything left is locked or waiting for its L2 store (or the policy offers
                # nothing, e.g. noop); the next write or the periodic tick tries again.  A
                # round that evicted objects whose extents are held back for an expired
                # lock's grace period did its part: their room comes back when that ends.
                if not evicted:
                    self._nothing_evictable()
                break
        now = time.monotonic()
        if now >= self._next_reap:
            try:
                expired = self.l1.expire_locks(now)
            finally:
                # Spaced out by its own cost, never run back to back (``next_sweep_at``): a
                # reap costs what expired, which a crashed client's many locks make a lot.
                # A pass stops at its budget: the rest is due as soon as its cost allows.
                interval = 0.0 if self.l1.reap_backlog else self.reap_interval_s
                self._next_reap = next_sweep_at(now, time.monotonic(), interval)
            if expired:
                self.stats.fail("l1_lock_expired", expired)

    def next_step_in(self) -> float | None:
        # A reap due before the regular interval ends wakes the thread for it; never sooner
        # than the floor, so that a reap interval of 0 (reap at every step) is no busy loop.
        floor = 0.0 if self.l1.reap_backlog else SWEEP_FLOOR_S
        return max(floor, self._next_reap - time.monotonic())

    def finish(self) -> None:
        try:
            self.l1.remove_listener(self._feed)
        except ValueError:
            pass
