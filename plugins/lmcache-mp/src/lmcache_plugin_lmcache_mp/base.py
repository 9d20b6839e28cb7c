"""What the operation handlers share: the storage, the state, and how a handler answers.

A handler returns the reply's value (``None`` for LMCache's "void": no payload frame) or
a :class:`Deferred` whose ``work`` runs on the pool and returns the loop-thread ``finish``
that produces the value.  A handler that raises :class:`RequestRefused` (or any exception)
gets no reply, as from LMCache's server: the front end logs it with the operation and
request ids and counts it; the client waits for its own timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_plugin_lmcache_mp.state import Instance, RequestTable
from lmcache_tiers.plugin import FrontendStats

if TYPE_CHECKING:
    from lmcache_plugin_lmcache_mp import LMCacheMPConfig
    from lmcache_plugin_lmcache_mp.pickled import PickleCodec
    from lmcache_tiers.plugin import StorageManager

__all__ = ["Deferred", "RequestRefused", "Shared"]


class RequestRefused(Exception):
    """A request LMCache's server would not answer either; ``reason`` is the failure counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Deferred:
    """Work for the pool; ``work()`` returns the loop-thread finisher producing the reply."""

    work: Callable[[], Callable[[], Any]]


@dataclass
class Shared:
    """The storage, the configuration and the state every handler works on."""

    storage: StorageManager
    config: LMCacheMPConfig
    stats: FrontendStats
    chunk_size: int
    #: (segment name, pool size) advertised at registration; None: chunks travel pickled
    shm: tuple[str, int] | None
    pickle: PickleCodec | None
    lock_ttl_s: float
    write_ttl_s: float
    instances: dict[int, Instance] = field(default_factory=dict)
    requests: RequestTable = field(default_factory=lambda: RequestTable(65536))
    stopping: threading.Event = field(default_factory=threading.Event)

    def instance(self, instance_id: int) -> Instance:
        """The registered instance a transfer is for.  The transfer refreshes its liveness,
        as in LMCache, but is no ping: a worker that never pinged keeps the longer grace."""
        found = self.instances.get(instance_id)
        if found is None:
            raise RequestRefused(
                "mp_unregistered_instance",
                f"instance {instance_id} has no registered KV layout "
                "(register_kv_cache_engine_driven_context first, or it was reaped after going silent)",
            )
        found.last_seen = time.monotonic()
        return found

    def layout_for(self, model_name: str, world_size: int) -> Instance | None:
        """An instance registered for this model and world size (they share one layout)."""
        for instance in self.instances.values():
            if instance.model_name == model_name and instance.world_size == world_size:
                return instance
        return None
