"""A timeout given to one call is checked as the client's own is: a positive number of
seconds (infinity included).  NaN used to fail deep inside the call ("cannot convert float
NaN to integer") and a negative or zero one meant "do not wait" (a timeout on a server that
answers in microseconds); both are one clear ValueError now, before anything is sent."""

from __future__ import annotations

import fractions
import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

BAD_TIMEOUTS = [math.nan, -1.0, 0.0, -math.inf]


def calls(keys: list[ObjectKey]) -> dict[str, Callable[[Client, float], Any]]:
    """The client's calls that take a timeout of their own."""
    return {
        "ping": lambda client, timeout: client.ping(timeout=timeout),
        "lookup": lambda client, timeout: client.lookup(keys, timeout=timeout),
        "lookup_many": lambda client, timeout: client.lookup_many([keys], timeout=timeout),
        "release": lambda client, timeout: client.release(keys, timeout=timeout),
    }


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize("call", sorted(calls([])))
def test_a_call_refuses_a_timeout_the_client_would_refuse(
    server: TiersServer, call: str, timeout: float
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(2)]
    with Client(server.endpoint) as client:
        assert client.store(keys, [b"x" * 64, b"y" * 64]) == 2
        refusal = f"timeout must be a positive number of seconds, got {timeout!r}"
        with pytest.raises(ValueError, match=refusal):
            calls(keys)[call](client, timeout)
        # Nothing was sent: no lookup left keys locked, no release dropped a lock.
        assert client.lookup(keys) == 2
        assert client.release(keys) == 2
        assert client.ping(timeout=math.inf) > 0


@pytest.mark.parametrize("timeout", [math.nan, -1.0, -math.inf], ids=repr)
def test_wait_prefetch_refuses_a_negative_or_nan_wait(server: TiersServer, timeout: float) -> None:
    # A handle the server never gave: a wait that is sent is answered NOT_FOUND.
    with Client(server.endpoint) as client:
        with pytest.raises(ValueError, match=f"wait must not be negative, got {timeout!r}"):
            client.wait_prefetch(987654, timeout)
        with pytest.raises(ServerError, match="NOT_FOUND"):
            client.wait_prefetch(987654, 0.0)  # a poll: sent


# A number of seconds of any real type: the time a LOOKUP asks the server to wait is the
# timeout given, and msgpack encodes no numpy scalar or Fraction (nor a bool as a float).
REAL_TIMEOUTS = [5, True, fractions.Fraction(5, 2), np.int64(5), np.float32(2.5)]


@pytest.mark.parametrize("timeout", REAL_TIMEOUTS, ids=lambda timeout: type(timeout).__name__)
@pytest.mark.parametrize("call", sorted(calls([])))
def test_a_call_takes_a_timeout_of_any_real_type(server: TiersServer, call: str, timeout: Any) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(2)]
    with Client(server.endpoint, timeout=timeout) as client:
        assert client.store(keys, [b"x" * 64, b"y" * 64]) == 2
        calls(keys)[call](client, timeout)
        client.release(keys)
        assert client.lookup(keys) == 2
        assert client.release(keys) == 2
        # A handle the server never gave: a wait that is sent is answered NOT_FOUND.
        with pytest.raises(ServerError, match="NOT_FOUND"):
            client.wait_prefetch(987654, timeout)
