"""L2: the interface the controllers use, and the one adapter that wraps any backend.

* :mod:`~lmcache_tiers.l2.interface` -- ``L2Adapter`` (non-blocking), ``L2Op``,
  ``LookupResult``, ``L2Listener``;
* :mod:`~lmcache_tiers.l2.adapter` -- ``BackendAdapter``: a backend (plain batch I/O, see
  :mod:`lmcache_tiers.protocols`) wrapped with threads or an event loop, eventfds, pins,
  accounting, capacity, serde and listeners;
* :mod:`~lmcache_tiers.l2.build` -- ``build_adapter`` / ``create_adapter``: factory ->
  backend -> adapter;
* :mod:`~lmcache_tiers.l2.context` -- ``AdapterContext`` (facts the StorageManager
  knows) and ``BackendContext`` (what a backend's factory receives);
* :mod:`~lmcache_tiers.l2.record` -- the header persistent backends store with an object.
"""

from lmcache_tiers.l2.adapter import BackendAdapter
from lmcache_tiers.l2.build import build_adapter, create_adapter
from lmcache_tiers.l2.context import AdapterContext, BackendContext
from lmcache_tiers.l2.interface import L2Adapter, L2Listener, L2Op, LookupResult
from lmcache_tiers.protocols import Capacity, ObjectSize

__all__ = [
    "AdapterContext",
    "BackendAdapter",
    "BackendContext",
    "Capacity",
    "L2Adapter",
    "L2Listener",
    "L2Op",
    "LookupResult",
    "ObjectSize",
    "build_adapter",
    "create_adapter",
]
