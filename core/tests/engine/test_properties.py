"""Random sequences of engine operations, with the engine's invariants checked after each.

After every step (once background work has settled): no write lock or L2 pin outlives
its operation, read locks are exactly those the test still holds, L1's byte accounting
equals the aligned sizes of the objects it holds, and every hit returned the bytes stored.
Besides plain steps, a client's write may land while a prefetch loads the same keys (the
write takes them from the load) and a forced clear of L1 while stores wait for L2.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from engine_support import GatedConfig, gated_backend, keys_of, make_storage, mock, payload
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey

ALIGN = 4096
prompts = st.integers(min_value=0, max_value=5)
lengths = st.integers(min_value=1, max_value=8)


def size_of(key: ObjectKey) -> int:
    # 4..64 KiB, not all multiples of the alignment, fixed per key
    return 4096 * (1 + key.chunk_hash[-1] % 16) - key.chunk_hash[-1] % 3


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        faulty = AdapterSpec(type="gated", config=GatedConfig())
        # 2 MiB of L1 so eviction and "L1 full" paths are exercised within a few steps.
        self.storage = make_storage([faulty, mock()], l1_gb=2 / 1024, l2_prefetch_max_in_flight=2)
        self.faulty = gated_backend(self.storage)
        self.known: set[ObjectKey] = set()
        self.held: Counter[ObjectKey] = Counter()

    def teardown(self) -> None:
        self.storage.close()

    def keys(self, prompt: int, length: int) -> list[ObjectKey]:
        return keys_of(prompt, length, model="prop")

    @rule(prompt=prompts, length=lengths, commit=st.sampled_from([True, True, True, False]))
    def store(self, prompt: int, length: int, commit: bool) -> None:
        self.write(self.keys(prompt, length), commit)

    def write(self, keys: list[ObjectKey], commit: bool) -> None:
        try:
            reserved = self.storage.reserve_write(keys, [size_of(k) for k in keys])
        except L1OutOfMemoryError:
            return  # everything left is locked: refusing the write is the right answer
        for key, obj in reserved.items():
            self.storage.view(obj)[:] = payload(key, size_of(key))
        if commit:
            assert all(self.storage.commit_write(list(reserved)))
            self.known.update(reserved)
        else:
            self.storage.abort_write(list(reserved))

    @rule(prompt=prompts, length=lengths, hold=st.booleans(), readers=st.integers(1, 2))
    def lookup(self, prompt: int, length: int, hold: bool, readers: int) -> None:
        keys = self.keys(prompt, length)
        self.take_hits(keys, self.storage.submit_prefetch(keys, readers=readers), hold, readers)

    def take_hits(self, keys: list[ObjectKey], handle: int, hold: bool, readers: int) -> None:
        """Wait for prefetch ``handle`` of ``keys``, check the hits' bytes, keep or release them."""
        hits = self.storage.wait_prefetch(handle, 30)
        assert hits is not None and 0 <= hits <= len(keys)
        prefix = keys[:hits]
        objects = self.storage.read(prefix)
        assert [obj.key for obj in objects] == prefix, "a reported hit is not readable"
        for obj in objects:
            assert bytes(self.storage.view(obj)) == payload(obj.key, size_of(obj.key))
        self.storage.release(prefix)
        if hold:
            for key in prefix:
                self.held[key] += readers
        else:
            self.storage.release(prefix, readers)

    @rule(prompt=prompts, length=lengths)
    def write_while_loading(self, prompt: int, length: int) -> None:
        # The loads from the gated adapter wait at its gate while a client writes the same
        # keys: each write finding its key reserved by a load takes it from the load.
        keys = self.keys(prompt, length)
        self.faulty.gate.clear()
        try:
            handle = self.storage.submit_prefetch(keys)
            self.write(keys, commit=True)
        finally:
            self.faulty.gate.set()
        self.take_hits(keys, handle, hold=False, readers=1)

    @precondition(lambda self: not self.held)  # the test's own read locks stay valid
    @rule(prompt=prompts, length=lengths)
    def force_clear_during_stores(self, prompt: int, length: int) -> None:
        self.faulty.store_gate.clear()
        try:
            self.write(self.keys(prompt, length), commit=True)
            self.storage.clear(force=True)
        finally:
            self.faulty.store_gate.set()

    @precondition(lambda self: bool(self.held))
    @rule()
    def release_held(self) -> None:
        for key, count in self.held.items():
            self.storage.release([key], count)
        self.held.clear()

    @rule(megabytes=st.integers(0, 2))
    def evict(self, megabytes: int) -> None:
        self.storage.l1_eviction.evict_now(megabytes << 20 or ALIGN)

    @rule()
    def clear_l1(self) -> None:
        self.storage.clear()

    @rule(prompt=prompts, length=lengths)
    def lose_from_l2(self, prompt: int, length: int) -> None:
        for adapter in self.storage.adapters:
            adapter.delete(self.keys(prompt, length))

    @rule(prompt=prompts, length=lengths, loads=st.booleans(), stores=st.booleans())
    def inject_faults(self, prompt: int, length: int, loads: bool, stores: bool) -> None:
        keys = self.keys(prompt, length)
        target = self.faulty.fail_loads if loads else self.faulty.fail_stores
        if stores or loads:
            target.update(keys)
        else:
            self.faulty.fail_loads.clear()
            self.faulty.fail_stores.clear()

    def unexpected_locks(self) -> str:
        """Which keys hold read locks the test does not, and whose: an L2 store task's
        (``storing``) or a reader's (a prefetch result not given back, or a leak)."""
        lines = []
        for key in sorted(self.known | set(self.held), key=lambda key: key.chunk_hash):
            obj = self.storage.l1.get(key)
            locks = obj.read_locks if obj is not None else 0
            if locks != self.held[key]:
                storing = obj.storing if obj is not None else 0
                lines.append(
                    f"{key.file_stem()}: {locks - storing} reader locks + {storing} store locks, "
                    f"the test holds {self.held[key]}"
                )
        status = self.storage.status()
        return (
            "read locks differ from those held:\n"
            + "\n".join(lines or ["(no known key differs: the locks are on keys the test never wrote)"])
            + f"\nstore: {status['store']}\nprefetch: {status.get('prefetch')}"
        )

    @invariant()
    def settled_state_is_consistent(self) -> None:
        storage = self.storage
        assert storage.flush(30)
        stats = storage.l1.stats()
        assert stats.write_locked == 0, "a write lock outlived its operation"
        assert stats.read_locks == sum(self.held.values()), self.unexpected_locks()
        for adapter in storage.adapters:
            assert adapter.pinned_keys() == {}, f"{adapter.name} kept pins"
        present = [key for key in self.known if storage.l1.contains(key)]
        assert len(storage.l1) == len(present), "L1 holds objects nobody wrote"
        assert stats.used_bytes == sum(aligned(size_of(key)) for key in present)
        assert all(storage.l1.contains(key) for key in self.held), "a read-locked object vanished"
        assert storage.status()["store"]["in_flight_tasks"] == 0


EngineMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineProperties = EngineMachine.TestCase
