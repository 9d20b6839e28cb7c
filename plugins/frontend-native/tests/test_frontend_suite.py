"""The native front end passes the front-end conformance suite."""

from __future__ import annotations

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey, prefix_keys
from lmcache_tiers.plugin import Frontend
from lmcache_tiers.testing.frontend import FrontendDriver, FrontendSuite
from lmcache_tiers.wire import protocol as p


def keys_of(request: int, count: int) -> list[ObjectKey]:
    return prefix_keys([request] * (count * 256), 256, model_name="suite")


class NativeDriver(FrontendDriver):
    def __init__(self, address: str) -> None:
        self.client = Client(address)

    def store(self, request: int, chunks: list[bytes]) -> bool:
        return self.client.store(keys_of(request, len(chunks)), chunks) == len(chunks)

    def lookup(self, request: int, count: int) -> int:
        keys = keys_of(request, count)
        hits = self.client.lookup(keys)
        self.client.release(keys[:hits])
        return hits

    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        keys = keys_of(request, count)
        with self.client.retrieve(keys) as views:
            found = [bytes(view) for view in views]
        return found if len(found) == count else None

    def hold(self, request: int, count: int) -> None:
        assert self.client.lookup(keys_of(request, count)) == count
        reserve = p.StoreReserve(0, "", keys_of(request + 1, count), [self.chunk_bytes] * count)
        self.client._call(reserve, p.StoreReserveReply)

    def alive(self) -> bool:
        self.client.ping()
        return True

    def close(self) -> None:
        self.client.close()


class TestNativeFrontend(FrontendSuite):
    component_name = "native"

    def make_driver(self, frontend: Frontend) -> FrontendDriver:
        return NativeDriver(frontend.address)
