"""Names of the objects in the pool, from the master's HTTP server.

The Mooncake client has no listing call; ``mooncake_master`` serves every key it holds,
one per line, at ``GET /get_all_keys`` on its metrics port.  The listing is read as a
stream (a pool holds millions of keys) and filtered by the adapter's prefix.
"""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Iterator

__all__ = ["iter_pool_names"]


def iter_pool_names(metrics_url: str, prefix: str, timeout_s: float) -> Iterator[str]:
    """Every key of the pool that starts with ``prefix``, as the master lists it.

    Raises ``ConnectionError`` naming ``master_metrics_url`` when the master does not
    answer in ``timeout_s``, answers with an error status or not as HTTP, or ends the
    connection before the length it announced.
    """
    url = metrics_url.rstrip("/") + "/get_all_keys"
    try:
        yield from _names(url, prefix.encode(), timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        # The start-up scan's warning shows this message: it names the field to check.
        raise ConnectionError(
            f"master_metrics_url {metrics_url}: GET /get_all_keys failed: {type(exc).__name__}: {exc}"
        ) from exc


def _names(url: str, encoded: bytes, timeout_s: float) -> Iterator[str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        # the length the master announced (None: chunked, where http.client itself
        # raises on a body cut short)
        announced = response.length
        received = 0
        for raw in response:
            received += len(raw)
            if not raw.endswith(b"\n") and announced is not None and received < announced:
                break  # a name cut off by the end of the connection: not a name
            line = raw.rstrip(b"\r\n")
            if line.startswith(encoded):
                yield line.decode("utf-8", "surrogateescape")
        if announced is not None and received < announced:
            # A connection closed early ends the iteration like the end of the body: taken
            # for the whole, part of the pool would be accounted as all of it.
            raise ConnectionError(
                f"the key listing at {url} was cut short: {received} of {announced} bytes arrived"
            )
