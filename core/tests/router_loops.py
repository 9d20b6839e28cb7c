"""RouterLoops for the loop's own tests: a ROUTER on a loopback port of its own, one pool
thread, frames up to 1 MiB, and a 50 ms sweep interval (its socket's receive timeout)."""

from __future__ import annotations

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import RouterLoop


def router_loop(
    *,
    drain_timeout_s: float,
    stats: FrontendStats | None = None,
    max_pool_requests: int | None = None,
    max_pool_bytes: int | None = None,
) -> RouterLoop:
    """A loop not started yet, counting into ``stats`` (fresh ones unless given), its
    pool bounded as given (by the loop's defaults otherwise)."""
    return RouterLoop(
        "tcp://127.0.0.1:0",
        name="t",
        stats=FrontendStats() if stats is None else stats,
        pool_workers=1,
        max_frame_bytes=1 << 20,
        sweep_interval_s=0.05,
        drain_timeout_s=drain_timeout_s,
        max_pool_requests=max_pool_requests,
        max_pool_bytes=max_pool_bytes,
    )
