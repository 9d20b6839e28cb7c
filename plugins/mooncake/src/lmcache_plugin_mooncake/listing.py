"""Names of the objects in the pool, from the master's HTTP server.

The Mooncake client has no listing call; ``mooncake_master`` serves every key it holds,
one per line, at ``GET /get_all_keys`` on its metrics port.  The listing is read as a
stream (a pool holds millions of keys) and filtered by the adapter's prefix.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

__all__ = ["iter_pool_names"]


def iter_pool_names(metrics_url: str, prefix: str, timeout_s: float) -> Iterator[str]:
    """Every key of the pool that starts with ``prefix``, as the master lists it.

    Raises ``OSError`` (``urllib.error.URLError``) when the master does not answer in
    ``timeout_s`` or answers with an error status.
    """
    url = metrics_url.rstrip("/") + "/get_all_keys"
    encoded = prefix.encode()
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        for raw in response:
            line = raw.rstrip(b"\r\n")
            if line.startswith(encoded):
                yield line.decode("utf-8", "surrogateescape")
