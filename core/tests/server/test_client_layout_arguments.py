"""``layouts`` of ``store`` and ``retrieve`` is one string per key: anything else is one
TypeError naming the argument, raised before anything is sent.  A layout of another type
used to fail deep inside the call (an AttributeError of ``startswith``, a TypeError of the
layout parser), and None went out as no layout at all."""

from __future__ import annotations

import os
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

LAYOUT = "float16[2,16]"  # 64 bytes


@pytest.mark.parametrize(
    ("layouts", "refusal"),
    [
        ([None], r"layouts\[0\] is a NoneType, not a str"),
        ([7], r"layouts\[0\] is a int, not a str"),
        ([LAYOUT.encode()], r"layouts\[0\] is a bytes, not a str"),
        (LAYOUT, r"layouts must be a sequence of strings, one per key, not a str"),
    ],
    ids=["none", "int", "bytes", "one-string"],
)
@pytest.mark.parametrize("call", ["store", "retrieve"])
def test_a_layout_that_is_not_a_string_is_refused_naming_the_argument(
    server: TiersServer, layouts: Any, refusal: str, call: str
) -> None:
    key = ObjectKey("unit", 0, os.urandom(8))
    with Client(server.endpoint) as client:
        with pytest.raises(TypeError, match=refusal):
            if call == "store":
                client.store([key], [b"x" * 64], layouts=layouts)
            else:
                with client.retrieve([key], layouts=layouts):
                    pytest.fail("the block ran")
        assert client.store([key], [b"x" * 64], layouts=[LAYOUT]) == 1  # nothing was stored before
        with client.retrieve([key], layouts=[LAYOUT]) as views:
            assert [bytes(view) for view in views] == [b"x" * 64]
