"""Python heap the server keeps per object: what an operator adds to the L1 arena when sizing.

Each structure is filled with N objects of 4 KiB (keys as a front end decodes them: one
model, rank 0, 32-byte hashes, no salt), and the bytes it holds are read with
``tracemalloc`` before and after (after a ``gc.collect()``), divided by N.  The key
objects themselves are made before each measurement and shared by every structure (one
key object per key in a server: the native front end's key cache hands out the same
object), so they are reported once, on their own line.  Figures are bytes per object (or
per key); the arena, an mmap, is not Python heap and is not counted.

* ``key``: one ``ObjectKey`` with its hash bytes and its entry in a list;
* ``l1``: an ``L1Manager`` holding N READY objects (object table and its indexes, the
  extent allocator, leases), written in batches of 256 as a STORE does;
* ``policy-<name>``: each shipped eviction policy told about the same writes;
* ``churned-<name>``: the same policy after 4N more keys were written through it with
  N held (each batch evicting as many of its victims): per live object, the key objects
  of its ghosts or history included -- the steady state once eviction runs;
* ``l2-accounting``: an adapter's ``ByteAccounting`` holding N stored sizes (what the fs
  and mock adapters keep per key in this process: neither keeps another per-key index);
* ``key-cache``: the native front end's key cache after decoding the N keys in lists of
  256 (bounded: it holds at most ``KEY_CACHE_ENTRIES`` keys, and is emptied when full);
* ``session-locks``: one native client session holding a read lock on each of N keys;
* ``mp-transfers``: the ``lmcache_mp`` front end's prepared store transfers of 256 keys
  each (keys, their identity tuple, the reserved objects by key) for N keys in flight.

    python bench/bench_memory.py [--counts 10000,100000,1000000]
"""

from __future__ import annotations

import functools
import gc
import itertools
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from bench_args import BenchParser
from lmcache_plugin_eviction_arc.policy import ARCEvictionPolicy
from lmcache_plugin_eviction_lru.policy import LRUEvictionPolicy
from lmcache_plugin_eviction_noop.policy import NoopEvictionPolicy
from lmcache_plugin_eviction_prefix_lfu.policy import PrefixLFUEvictionPolicy
from lmcache_plugin_eviction_s3fifo.policy import S3FIFOEvictionPolicy
from lmcache_plugin_frontend_native.sessions import Session
from lmcache_plugin_lmcache_mp.state import PendingTransfers, Transfer

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.manager import L1Manager
from lmcache_tiers.l2.accounting import ByteAccounting
from lmcache_tiers.protocols import ObjectSize
from lmcache_tiers.wire.decoding import KeyCache

OBJECT_BYTES = 4096
BATCH = 256
#: turnovers of the held keys a churned policy sees: enough to fill the history
#: ``prefix_lfu`` keeps by default (4 evicted keys per live one) and the others' ghosts
CHURN_TURNOVERS = 4


def make_keys(count: int) -> list[ObjectKey]:
    return make_keys_from(0, count)


def make_keys_from(first: int, count: int) -> list[ObjectKey]:
    return [ObjectKey("bench-model", 0, index.to_bytes(32, "big")) for index in range(first, first + count)]


def batches(keys: Sequence[ObjectKey]) -> list[Sequence[ObjectKey]]:
    return [keys[start : start + BATCH] for start in range(0, len(keys), BATCH)]


def heap_growth(build: Callable[[], Any]) -> tuple[int, Any]:
    """Python heap bytes that ``build``'s result still holds once built (it is returned, so
    it stays alive until the caller is done with it)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    result = build()
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before, result


def fill_l1(keys: list[ObjectKey]) -> L1Manager:
    l1 = L1Manager(len(keys) * OBJECT_BYTES, prefault=False)
    for batch in batches(keys):
        l1.reserve_write(batch, [OBJECT_BYTES] * len(batch))
        l1.finish_write(batch)
    return l1


def fill_policy(factory: Callable[[], Any], keys: list[ObjectKey]) -> Any:
    policy = factory()
    for batch in batches(keys):
        policy.on_keys_written(batch)
    return policy


def churn_policy(factory: Callable[[], Any], keys: list[ObjectKey]) -> Any:
    """``factory``'s policy holding as many keys as ``keys`` after ``CHURN_TURNOVERS`` times
    as many other keys went through it (each batch evicting as many victims), the keys made
    here so that those only its ghosts or history keep are counted."""
    policy = fill_policy(factory, keys)
    if isinstance(policy, NoopEvictionPolicy):
        return policy  # it never offers a victim: nothing leaves
    for start in range(len(keys), (CHURN_TURNOVERS + 1) * len(keys), BATCH):
        batch = make_keys_from(start + len(keys), BATCH)
        victims = list(itertools.islice(policy.victims(), BATCH))
        policy.on_keys_removed(victims)
        policy.on_keys_written(batch)
    return policy


def fill_accounting(keys: list[ObjectKey]) -> ByteAccounting:
    accounting = ByteAccounting()
    for batch in batches(keys):
        accounting.record_many((key, ObjectSize(OBJECT_BYTES, OBJECT_BYTES)) for key in batch)
    return accounting


def fill_key_cache(encoded: list[bytes]) -> KeyCache:
    import msgspec

    cache = KeyCache()
    for start in range(0, len(encoded), BATCH):
        cache.keys_of([msgspec.Raw(piece) for piece in encoded[start : start + BATCH]])
    return cache


def fill_session(keys: list[ObjectKey]) -> Session:
    session = Session(b"client", 0.0)
    for batch in batches(keys):
        session.add_read_locks(list(batch), 300.0)
    session.lock_deadlines  # noqa: B018 -- indexes the records, as a RELEASE or sweep does
    return session


def fill_transfers(keys: list[ObjectKey]) -> PendingTransfers:
    pending = PendingTransfers()
    for number, batch in enumerate(batches(keys)):
        held = list(batch)
        # The reserved L1 objects are L1's (counted there): only the mapping is the transfer's.
        transfer = Transfer(held, 300.0, f"request-{number}", reserved=dict.fromkeys(held))
        pending.add(1, held, transfer)
    return pending


POLICIES: dict[str, Callable[[], Any]] = {
    "lru": LRUEvictionPolicy,
    "arc": ARCEvictionPolicy,
    "s3fifo": S3FIFOEvictionPolicy,
    "prefix_lfu": PrefixLFUEvictionPolicy,
    "noop": NoopEvictionPolicy,
}


def measure(count: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    grown, keys = heap_growth(lambda: make_keys(count))
    figures["key"] = grown / count
    grown, l1 = heap_growth(lambda: fill_l1(keys))
    figures["l1"] = grown / count
    l1.close()
    del l1
    for name, factory in POLICIES.items():
        grown, _policy = heap_growth(lambda factory=factory: fill_policy(factory, keys))
        figures[f"policy-{name}"] = grown / count
        del _policy
    for name, factory in POLICIES.items():
        grown, _policy = heap_growth(lambda factory=factory: churn_policy(factory, keys))
        figures[f"churned-{name}"] = grown / count
        del _policy
    grown, _accounting = heap_growth(lambda: fill_accounting(keys))
    figures["l2-accounting"] = grown / count
    del _accounting
    encoded = [key.to_bytes() for key in keys]
    grown, cache = heap_growth(functools.partial(fill_key_cache, encoded))
    figures["key-cache"] = grown / max(1, len(cache))
    figures["key-cache-entries"] = len(cache)
    del cache, encoded
    grown, _session = heap_growth(lambda: fill_session(keys))
    figures["session-locks"] = grown / count
    del _session
    grown, _transfers = heap_growth(lambda: fill_transfers(keys))
    figures["mp-transfers"] = grown / count
    return figures


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument("--counts", default="10000,100000,1000000", help="object counts, comma-separated")
    args = parser.parse_args()
    counts = [int(text) for text in args.counts.split(",")]
    tracemalloc.start()
    results = {count: measure(count) for count in counts}
    names = list(results[counts[0]])
    print(f"{'bytes per object':<20}" + "".join(f"{count:>12,}" for count in counts))
    for name in names:
        print(f"{name:<20}" + "".join(f"{results[count][name]:>12,.0f}" for count in counts))


if __name__ == "__main__":
    main()
