"""L2: the adapter interface the controllers use and the base classes plugins subclass.

* :mod:`~lmcache_tiers.l2.interface` -- ``L2Adapter`` (non-blocking), ``L2Op``,
  ``LookupResult``, ``L2Listener``;
* :mod:`~lmcache_tiers.l2.base` -- ``BatchL2Adapter`` / ``AsyncBatchL2Adapter``: write plain
  batch I/O, get threads, eventfds, pins, accounting, serde and listeners for free;
* :mod:`~lmcache_tiers.l2.context` -- ``AdapterContext`` handed to every factory;
* :mod:`~lmcache_tiers.l2.record` -- the header persistent adapters store with an object;
* :mod:`~lmcache_tiers.l2.blocking` -- blocking calls for tests, tools and wrappers.
"""

from lmcache_tiers.l2.accounting import ObjectSize
from lmcache_tiers.l2.base import AsyncBatchL2Adapter, BatchL2Adapter
from lmcache_tiers.l2.blocking import BlockingAdapterClient
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import L2Adapter, L2Listener, L2Op, LookupResult

__all__ = [
    "AdapterContext",
    "AsyncBatchL2Adapter",
    "BatchL2Adapter",
    "BlockingAdapterClient",
    "L2Adapter",
    "L2Listener",
    "L2Op",
    "LookupResult",
    "ObjectSize",
]
