"""L1: the shared-memory arena or NVMe block file, the extent allocator, and the object/lock manager."""

from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.arena import L1Arena, default_segment_name, remove_stale_segments
from lmcache_tiers.l1.backing import L1Backing
from lmcache_tiers.l1.loan import L1Loan
from lmcache_tiers.l1.manager import L1Manager
from lmcache_tiers.l1.nvme import NvmeL1File, aligned_buffer, remove_stale_block_files
from lmcache_tiers.l1.objects import Eviction, L1Listener, L1Object, L1Stats, ObjectState

__all__ = [
    "Eviction",
    "ExtentAllocator",
    "L1Arena",
    "L1Backing",
    "L1Listener",
    "L1Loan",
    "L1Manager",
    "L1Object",
    "L1Stats",
    "NvmeL1File",
    "ObjectState",
    "aligned_buffer",
    "default_segment_name",
    "remove_stale_block_files",
    "remove_stale_segments",
]
