"""The simulator's L1 model against the rules it copies, and against the real engine."""

from pathlib import Path

import pytest
from replay_support import synthetic_lines, write_trace

from lmcache_tiers.config import build_config
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay.capacity import l1_size_for_blocks
from lmcache_tiers.replay.inprocess import replay_in_process
from lmcache_tiers.replay.model import CacheModel, L1Model, TwoTierModel
from lmcache_tiers.replay.run import ReplayOptions
from lmcache_tiers.replay.simulate import ExactLRU, TierSettings, policy_factories, simulate_policy
from lmcache_tiers.replay.trace import KeySpace, read_trace

space = KeySpace()


def keys(*blocks: int) -> list[ObjectKey]:
    return space.keys(blocks)


class Recorder(ExactLRU):
    """ExactLRU that logs every call, to check what the model tells a policy."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def on_keys_written(self, batch):  # type: ignore[no-untyped-def]
        self.calls.append(("written", [KeySpace.block_of(k) for k in batch]))
        super().on_keys_written(batch)

    def on_keys_read(self, batch):  # type: ignore[no-untyped-def]
        self.calls.append(("read", [KeySpace.block_of(k) for k in batch]))
        super().on_keys_read(batch)

    def on_keys_removed(self, batch):  # type: ignore[no-untyped-def]
        self.calls.append(("removed", [KeySpace.block_of(k) for k in batch]))
        super().on_keys_removed(batch)


def test_a_request_reads_its_prefix_twice_then_stores_the_rest() -> None:
    policy = Recorder()
    model = TwoTierModel(L1Model(policy, 10), None)
    assert model.request(keys(1, 2, 3)) == (0, 0)
    assert model.request(keys(1, 2, 4)) == (2, 0)
    assert policy.calls == [("written", [1, 2, 3]), ("read", [1, 2]), ("read", [1, 2]), ("written", [4])]


def test_a_full_l1_frees_as_many_blocks_as_the_store_names() -> None:
    policy = Recorder()
    l1 = L1Model(policy, 5)
    model = TwoTierModel(l1, None)
    model.request(keys(1, 2, 3, 4))  # 1 block left free
    model.request(keys(1, 9, 8))  # 2 new blocks do not fit: 2 victims go, though 1 would do
    assert policy.calls[-2:] == [("removed", [4, 3]), ("written", [9, 8])]
    assert l1.free == 1 and l1.evicted == 2


def test_a_store_that_cannot_fit_is_refused_whole() -> None:
    l1 = L1Model(ExactLRU(), 3)
    model = TwoTierModel(l1, None)
    assert l1.store(keys(1, 2, 3, 4)) == []
    assert l1.refused_stores == 1 and not l1.present
    model.request(keys(5, 6))
    assert l1.present == set(keys(5, 6))


def test_present_blocks_after_a_hole_are_not_stored_again() -> None:
    policy = Recorder()
    l1 = L1Model(policy, 10)
    l1.add(keys(1, 3))
    assert l1.store(keys(2, 3)) == keys(2)
    assert policy.calls[-1] == ("written", [2])


def test_background_eviction_at_the_watermark() -> None:
    l1 = L1Model(ExactLRU(), 10, trigger_watermark=0.8, eviction_ratio=0.25)
    l1.store(keys(*range(8)))  # 80 % used: a quarter of 8 blocks goes
    assert len(l1.present) == 6


def test_background_eviction_goes_on_until_below_the_watermark() -> None:
    # As the server's eviction thread: a round that leaves L1 above the watermark is
    # followed by another (10 -> 9 -> 8 -> 7 blocks of 10, at a tenth of them a round).
    l1 = L1Model(ExactLRU(), 10, trigger_watermark=0.8, eviction_ratio=0.1)
    l1.store(keys(*range(10)))
    assert len(l1.present) == 7
    assert l1.evicted == 3


def test_l2_hits_are_loaded_as_temporary_objects() -> None:
    policy = Recorder()
    l1, l2 = L1Model(policy, 2), CacheModel(ExactLRU(), 100)
    model = TwoTierModel(l1, l2)
    model.request(keys(1, 2))
    model.request(keys(3, 4))  # evicts 1 and 2 from L1; L2 keeps all four
    policy.calls.clear()
    assert model.request(keys(1, 2, 5)) == (0, 2)
    assert policy.calls[0] == ("removed", [4, 3])  # room for the load
    assert policy.calls[1:4] == [("written", [1, 2]), ("read", [1, 2]), ("removed", [1, 2])]
    assert policy.calls[4] == ("written", [5])


def test_the_lru_plugin_is_exact_lru(synthetic_trace) -> None:  # type: ignore[no-untyped-def]
    factories = policy_factories(load_registry(), ["LRU"])
    for capacity in (3, 10, 40, 200):
        exact = simulate_policy(synthetic_trace, "exact", ExactLRU, capacity)
        plugin = simulate_policy(synthetic_trace, "LRU", factories["LRU"], capacity)
        assert (plugin.hit_blocks, plugin.l1_evictions) == (exact.hit_blocks, exact.l1_evictions)


@pytest.mark.parametrize("capacity", [6, 25, 80])
def test_the_engine_gives_the_simulated_hits_for_every_policy(tmp_path: Path, capacity: int) -> None:
    """Replaying through a real StorageManager (L1 only, never background eviction) hits
    exactly the blocks the model predicts, whichever policy orders evictions."""
    trace = read_trace(write_trace(tmp_path / "t.jsonl", synthetic_lines(5, requests=250)))
    registry = load_registry()
    block_bytes = 8192
    size_gb, align = l1_size_for_blocks(capacity, block_bytes)
    for name, factory in policy_factories(registry).items():
        if name == "exact LRU":
            continue
        config = build_config(
            registry,
            overrides={
                "l1_size_gb": size_gb,
                "l1_align_bytes": align,
                "eviction_policy": name,
                "eviction_trigger_watermark": 1.0,
            },
        )
        report = replay_in_process(config, trace, ReplayOptions(block_bytes=block_bytes), registry=registry)
        simulated = simulate_policy(trace, name, factory, capacity, settings=TierSettings())
        real = report.totals
        assert real.corrupt_blocks == real.failed_requests == real.short_retrieves == 0
        assert (real.hit_blocks, real.refused_stores) == (simulated.hit_blocks, simulated.refused_stores), (
            name
        )
        assert report.server["l1_evicted_blocks"] == simulated.l1_evictions, name
