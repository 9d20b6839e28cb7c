"""An HTTP endpoint for tests of the endpoint itself: empty documents, the failures it
counts kept in order."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lmcache_tiers.server.http import HttpEndpoint


@contextmanager
def counting_endpoint() -> Iterator[tuple[HttpEndpoint, list[str]]]:
    """A started endpoint on a free loopback port and the reasons of the failures it
    counts; stopped on exit -- its connection threads joined, so whatever they count is in
    the list once the block is left."""
    counted: list[str] = []
    served = HttpEndpoint(
        "127.0.0.1", 0, metrics=bytes, status=dict, health=lambda: (True, "ok"), failed=counted.append
    )
    served.start()
    try:
        yield served, counted
    finally:
        served.stop()


def port_of(served: HttpEndpoint) -> int:
    """The port ``served`` listens on."""
    return int(served.url.rsplit(":", 1)[1])
