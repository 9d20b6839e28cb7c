"""Clusters of a test's own, started before the test asks for one.

A new cluster is not writable until 2 s after its nodes start (Redis's writable delay for
a primary), whatever the machine's speed: started one per test, that wait adds up.  Spare
clusters start in the background while earlier tests run, so a test that takes one still
gets a cluster nothing else has used -- fresh nodes, fresh ACLs, no keys.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from lmcache_plugin_redis.testing import RedisClusterNodes


class ClusterSpares:
    """``depth`` clusters kept starting ahead; :meth:`take` hands one out and starts its
    replacement.  :meth:`close` stops the spares no test took."""

    def __init__(self, directory: Path, depth: int = 3) -> None:
        self._directory = directory
        self._numbers = itertools.count()
        self._starter = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="spare-cluster")
        self._spares: deque[Future[RedisClusterNodes]] = deque(self._start() for _ in range(depth))

    def _start(self) -> Future[RedisClusterNodes]:
        # Ports are picked here, one cluster at a time, so no two spares share one.
        cluster = RedisClusterNodes(self._directory / f"cluster-{next(self._numbers)}")
        return self._starter.submit(cluster.start)

    def take(self) -> RedisClusterNodes:
        spare = self._spares.popleft()
        self._spares.append(self._start())
        try:
            return spare.result()
        except Exception:
            # A spare that could not start (a port taken meanwhile): one started now
            # raises what went wrong if it cannot start either.
            return RedisClusterNodes(self._directory / f"cluster-{next(self._numbers)}").start()

    def close(self) -> None:
        while self._spares:
            spare = self._spares.popleft()
            if spare.exception() is None:
                spare.result().stop()
        self._starter.shutdown()
