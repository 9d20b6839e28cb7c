"""L1: the shared-memory arena, its extent allocator, and the object/lock manager."""

from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.arena import L1Arena, default_segment_name, remove_stale_segments
from lmcache_tiers.l1.manager import L1Manager
from lmcache_tiers.l1.objects import L1Listener, L1Object, L1Stats, ObjectState

__all__ = [
    "ExtentAllocator",
    "L1Arena",
    "L1Listener",
    "L1Manager",
    "L1Object",
    "L1Stats",
    "ObjectState",
    "default_segment_name",
    "remove_stale_segments",
]
