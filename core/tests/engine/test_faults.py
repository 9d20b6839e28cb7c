"""The engine under injected faults: it keeps answering and gives every lock and byte back."""

from __future__ import annotations

import random

from engine_support import keys_of, payload, spec

from lmcache_tiers.errors import L1OutOfMemoryError

OPERATIONS = 10_000
SIZE = 16 * 1024


def faulty(index: int, mode: str, **extra: object) -> object:
    return spec(
        {
            "type": "fault_inject",
            "inner": {"type": "mock", "max_size_gb": 32 / 1024},
            "seed": index,
            "store_fail_rate": 0.3,
            "lookup_fail_rate": 0.3,
            "load_fail_rate": 0.3,
            "delete_fail_rate": 0.3,
            "fail_mode": mode,
            "eviction": {"trigger_watermark": 0.8, "eviction_ratio": 0.2},
            **extra,
        },
        index,
    )


def test_thirty_percent_faults_on_every_operation(engine) -> None:
    storage = engine(
        [
            faulty(0, "keys", corrupt_rate=0.3, corrupt_detected=True),
            faulty(1, "raise", delay_s=0.001, delay_rate=0.05),
        ],
        l2_prefetch_max_in_flight=4,
    )
    baseline = storage.l1.stats()
    rng = random.Random(1234)
    held: list[tuple[list, int]] = []
    answered = refused_writes = hits_checked = 0

    for _ in range(OPERATIONS):
        choice = rng.random()
        keys = keys_of(rng.randrange(300), rng.randint(1, 6))
        if choice < 0.45:
            try:
                reserved = storage.reserve_write(keys, [SIZE] * len(keys))
            except L1OutOfMemoryError:
                refused_writes += 1
                continue
            for key, obj in reserved.items():
                storage.view(obj)[:] = payload(key, SIZE)
            storage.commit_write(list(reserved))
        elif choice < 0.9:
            readers = rng.randint(1, 2)
            hits = storage.wait_prefetch(storage.submit_prefetch(keys, readers=readers), 30)
            assert hits is not None, "a lookup went unanswered"
            answered += 1
            objects = storage.read(keys[:hits])
            assert len(objects) == hits
            for obj in objects:
                assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
                hits_checked += 1
            storage.release(keys[:hits])
            if rng.random() < 0.2:
                held.append((keys[:hits], readers))
            else:
                storage.release(keys[:hits], readers)
        elif choice < 0.95 and held:
            prefix, readers = held.pop(rng.randrange(len(held)))
            storage.release(prefix, readers)
        elif choice < 0.98:
            storage.l1_eviction.evict_now(rng.randint(1, 8) << 20)
        else:
            storage.clear()

    for prefix, readers in held:
        storage.release(prefix, readers)
    assert storage.flush(60)
    status = storage.status()
    assert answered > OPERATIONS // 3
    assert hits_checked > 0
    assert status["requests"]["l2_hit_chunks"] > 0, "nothing was ever served from L2"
    assert status["failures"]["l2_load_failed"] > 0
    assert sum(a["keys_store_failed"] for a in status["adapters"]) > 0
    assert sum(a["keys_evicted"] for a in status["adapters"]) > 0
    for adapter in storage.adapters:
        assert adapter.pinned_keys() == {}
    storage.clear()
    assert storage.l1.stats() == baseline
    assert refused_writes == 0
