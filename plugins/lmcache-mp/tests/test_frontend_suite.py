"""The LMCache front end passes the front-end conformance suite."""

from __future__ import annotations

import itertools

from mpclient import Key, MPClient, Registration, tokens_of

from lmcache_tiers.plugin import Frontend
from lmcache_tiers.testing.frontend import FrontendDriver, FrontendSuite

REG = Registration()


class LMCacheDriver(FrontendDriver):
    chunk_bytes = REG.object_bytes

    def __init__(self, address: str) -> None:
        self.client = MPClient(address)
        self.shm = self.client.register(REG)["shm_name"]
        self._ids = itertools.count()

    def _key(self, request: int, count: int, **fields: object) -> Key:
        return Key(tokens_of(request, count * 256), f"suite-{next(self._ids)}", end=count * 256, **fields)  # type: ignore[arg-type]

    def store(self, request: int, chunks: list[bytes]) -> bool:
        return self.client.store(
            self._key(request, len(chunks), worker_id=0), REG.instance_id, chunks, self.shm
        )

    def lookup(self, request: int, count: int) -> int:
        key = self._key(request, count)
        hits = self.client.lookup(key)
        self.client.call("end_session", key.request_id)  # gives the lookup's locks back
        return hits or 0

    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        return self.client.retrieve(self._key(request, count, worker_id=0), REG.instance_id, self.shm)

    def hold(self, request: int, count: int) -> None:
        assert self.client.lookup(self._key(request, count)) == count
        prepared = self.client.call(
            "prepare_store", self._key(request + 1, count, worker_id=0).encode(), REG.instance_id
        )
        assert len(prepared["context"]["slots"]) == count

    def alive(self) -> bool:
        return self.client.call("noop") == "OK"

    def close(self) -> None:
        self.client.close()


class TestLMCacheFrontend(FrontendSuite):
    component_name = "lmcache_mp"

    def make_driver(self, frontend: Frontend) -> FrontendDriver:
        return LMCacheDriver(frontend.address)
