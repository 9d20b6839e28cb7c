"""Background controllers: L2 store, L2 prefetch, L1 eviction and per-adapter L2 eviction.

Each is one thread sleeping in ``poll`` on its adapters' eventfds and a wake-up fd of its
own; the StorageManager builds, starts and stops them.
"""

from lmcache_tiers.controllers.base import (
    AdapterSlot,
    ControllerThread,
    TaskTracker,
    Waker,
    adapter_infos,
    aligned_total,
)
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.prefetch import PrefetchController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.controllers.store import StoreController

__all__ = [
    "AdapterSlot",
    "ControllerThread",
    "EngineStats",
    "L1EvictionController",
    "L2EvictionController",
    "PrefetchController",
    "StoreController",
    "TaskTracker",
    "Waker",
    "adapter_infos",
    "aligned_total",
]
