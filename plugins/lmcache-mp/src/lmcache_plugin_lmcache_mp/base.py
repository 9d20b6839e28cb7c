"""What the operation handlers share: the storage, the state, and how a handler answers.

A handler returns the reply's value (``None`` for LMCache's "void": no payload frame), a
:class:`Prepared` reply that hands the client slots, or a :class:`Deferred` whose ``work``
runs on the pool and returns the loop-thread ``finish`` that produces the value.  A
handler that raises :class:`RequestRefused` (or any exception) gets no reply, as from
LMCache's server: the front end logs it with the operation and request ids and counts it;
the client waits for its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache_plugin_lmcache_mp.chunks import (
    ChunkRange,
    chunk_range,
    first_chunk,
    full_chunks,
    remembered_bytes,
    request_id_bytes,
)
from lmcache_plugin_lmcache_mp.state import Instance, RequestState, RequestTable
from lmcache_plugin_lmcache_mp.wire import CacheKey
from lmcache_tiers.plugin import BurstLog, FrontendStats, KeyValidationError, printable

if TYPE_CHECKING:
    from lmcache_plugin_lmcache_mp import LMCacheMPConfig
    from lmcache_plugin_lmcache_mp.pickled import PickleCodec
    from lmcache_tiers.plugin import StorageManager

__all__ = ["Deferred", "Prepared", "RequestRefused", "RequestTooLarge", "Shared", "failure_reason"]

logger = logging.getLogger(__name__)


class RequestRefused(Exception):
    """A request LMCache's server would not answer either; ``reason`` is the failure counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestTooLarge(RequestRefused):
    """A request naming more keys than ``max_request_keys``, or whose tokens would take
    more than ``max_remembered_mb`` by themselves; ``keys`` is how many it named."""

    def __init__(self, message: str, keys: int) -> None:
        super().__init__("mp_request_too_large", message)
        self.keys = keys


def failure_reason(exc: BaseException) -> str:
    """The failure counter of a request whose handler raised ``exc``."""
    if isinstance(exc, RequestRefused):
        return exc.reason
    if isinstance(exc, KeyValidationError | ValueError):
        return "mp_bad_request"
    return "mp_handler_error"


@dataclass
class Deferred:
    """Work for the pool; ``work()`` returns the loop-thread finisher producing the reply.

    ``counted_at_stop``, asked at the loop's end of a request never answered: whether the
    stop counted it (None: the loop decides by the operation)."""

    work: Callable[[], Callable[[], Any]]
    counted_at_stop: Callable[[], bool] | None = None


@dataclass
class Prepared:
    """A prepare's reply, which hands the client slots it holds for it (reserved or
    read-locked), and what gives them back if the reply cannot be sent: a client that
    never got the slots never copies into or out of them, nor commits them."""

    reply: Any
    undelivered: Callable[[], None]


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
    too_large_log: BurstLog = field(default_factory=lambda: BurstLog(logger, "mp_request_too_large"))
    #: gives back what requests forgotten by :meth:`remember` held, and counts them (the lookups')
    forget_for_memory: Callable[[list[RequestState]], None] = field(default=lambda states: None)

    def chunks_of(
        self, key: CacheKey, *, ranks: int, from_zero: bool = False, kept: bool = False
    ) -> ChunkRange:
        """The chunks of ``key``'s range, hashed with its request's remembered hashes.

        Checked first, before anything is hashed or remembered: the keys the range names
        (``ranks`` objects a chunk) within ``max_request_keys``, and what the request would
        keep (its tokens and hashes; the keys too when ``kept``, a lookup's) within
        ``max_remembered_mb``.  Otherwise raises
        :class:`RequestTooLarge`."""
        hashed = full_chunks(key, self.chunk_size)
        first = 0 if from_zero else min(hashed, first_chunk(key, self.chunk_size))
        keys = (hashed - first) * ranks
        if keys > self.config.max_request_keys:
            raise RequestTooLarge(
                f"it names {keys} keys ({hashed - first} chunks x {ranks} ranks), more than "
                f"max_request_keys ({self.config.max_request_keys})",
                keys,
            )
        needed = remembered_bytes(hashed, self.chunk_size, keys if kept else 0)
        needed += request_id_bytes(key.request_id)
        if needed > self.requests.max_bytes:
            raise RequestTooLarge(
                f"its {hashed} chunks of tokens, {keys if kept else 0} lookup keys and "
                f"{len(key.request_id)}-character request id would take "
                f"{needed >> 20} MiB to remember, more "
                f"than max_remembered_mb ({self.requests.max_bytes >> 20})",
                keys,
            )
        state = self.requests.get(key.request_id, time.monotonic())
        chunks = chunk_range(key, self.chunk_size, state.hashes, from_zero=from_zero)
        self.remember(state)
        return chunks

    def remember(self, state: RequestState) -> None:
        """Take the grown size of ``state`` into the requests' total, and forget the least
        recently seen other requests while the total is over ``max_remembered_mb``.  Here,
        not at the next sweep: requests arriving between two sweeps, each within the bound,
        would otherwise add up to any multiple of it."""
        self.requests.account(state)
        dropped = self.requests.over_memory(keep=state)
        if dropped:
            self.forget_for_memory(dropped)

    def refuse_too_large(self, operation: str, key: CacheKey, exc: RequestTooLarge) -> None:
        """Count and log a request refused by :meth:`chunks_of` (its caller answers it)."""
        self.stats.failure(exc.reason)
        self.too_large_log.warn(
            operation,
            "%s of request %s refused: %s (failure reason %s)",
            operation,
            printable(key.request_id),
            exc,
            exc.reason,
        )

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
