"""The native front end passes the front-end conformance suite, and the suite fails it
when seen through a client with one defect."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey, prefix_keys
from lmcache_tiers.plugin import Frontend
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.frontend import FrontendDriver, FrontendSuite
from lmcache_tiers.wire import protocol as p


def keys_of(request: int, count: int) -> list[ObjectKey]:
    return prefix_keys([request] * (count * 256), 256, model_name="suite")


class NativeDriver(FrontendDriver):
    """A sound client of the native front end."""

    def __init__(self, address: str) -> None:
        self.client = Client(address)

    def keys(self, request: int, count: int) -> list[ObjectKey]:
        return keys_of(request, count)

    def store(self, request: int, chunks: list[bytes]) -> bool:
        return self.client.store(self.keys(request, len(chunks)), chunks) == len(chunks)

    def lookup(self, request: int, count: int) -> int:
        keys = self.keys(request, count)
        hits = self.client.lookup(keys)
        self.client.release(keys[:hits])
        return hits

    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        with self.client.retrieve(self.keys(request, count)) as views:
            found = [bytes(view) for view in views]
        return found if len(found) == count else None

    def hold(self, request: int, count: int) -> None:
        assert self.client.lookup(self.keys(request, count)) == count
        reserve = p.StoreReserve(0, "", self.keys(request + 1, count), [self.chunk_bytes] * count)
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


# -- the suite fails front ends that hand out wrong bytes or keep what they should give
# back (it is not a suite that always passes).  Each broken front end is the native one
# seen through a client with one defect: what the suite sees of a front end is what its
# driver reports, so a driver that reorders bytes is a front end that reorders bytes.  The
# suite test named next to it runs outside pytest's collection, over the suite's own
# StorageManager and front end, and must raise AssertionError.


class KeysIgnoreTheRequest(NativeDriver):
    """Keys derived from the number of chunks only: every request of a length is one."""

    def keys(self, request: int, count: int) -> list[ObjectKey]:
        return keys_of(0, count)


class SwapsBytePairs(NativeDriver):
    """Reads chunks back with each pair of bytes swapped (a 16-bit element's byte order)."""

    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        found = super().retrieve(request, count)
        if found is None:
            return None
        swapped = []
        for chunk in found:
            pairs = bytearray(chunk)
            pairs[0::2], pairs[1::2] = chunk[1::2], chunk[0::2]
            swapped.append(bytes(pairs))
        return swapped


class PadsPartialHits(NativeDriver):
    """Answers a retrieve of a partly stored request with zeros for the missing chunks."""

    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        keys = self.keys(request, count)
        with self.client.retrieve(keys) as views:
            found = [bytes(view) for view in views]
        if not found:
            return None
        return found + [bytes(self.chunk_bytes)] * (count - len(found))


class LeavesAReservationPerStore(NativeDriver):
    """Each store also reserves a chunk it never commits nor gives back."""

    def store(self, request: int, chunks: list[bytes]) -> bool:
        stored = super().store(request, chunks)
        leaked = keys_of(10_000 + request, 1)
        self.client._call(p.StoreReserve(0, "", leaked, [self.chunk_bytes]), p.StoreReserveReply)
        return stored


class _SuiteOn(FrontendSuite):
    component_name = "native"

    def __init__(self, driver: type[NativeDriver]) -> None:
        self.driver_type = driver

    def make_driver(self, frontend: Frontend) -> FrontendDriver:
        return self.driver_type(frontend.address)


def run_suite_test(driver_type: type[NativeDriver], name: str) -> None:
    """Run the suite test ``name`` with ``driver_type``; its assertion errors propagate."""
    suite = _SuiteOn(driver_type)
    storage = StorageManager(suite._server_config(), load_registry())
    try:
        frontend = suite._create(storage, storage.config)
        frontend.start()
        driver = suite.make_driver(frontend)
        fixtures: dict[str, Any] = {"storage": storage, "frontend": frontend, "driver": driver}
        test = getattr(suite, name)
        try:
            test(**{parameter: fixtures[parameter] for parameter in inspect.signature(test).parameters})
        finally:
            driver.close()
            frontend.stop(force=True)
            if not frontend.join(30):  # not an AssertionError: that is what the test expects
                raise RuntimeError("the front end did not stop")
    finally:
        storage.close(drain_timeout_s=0.0)


CAUGHT: list[tuple[type[NativeDriver], str]] = [
    (KeysIgnoreTheRequest, "test_requests_read_back_their_own_chunks"),
    (SwapsBytePairs, "test_stored_chunks_read_back_equal"),
    (PadsPartialHits, "test_a_miss_is_a_miss"),
    (LeavesAReservationPerStore, "test_stored_chunks_read_back_equal"),
]


@pytest.mark.parametrize(
    ("driver", "name"), CAUGHT, ids=[f"{driver.__name__}-{name}" for driver, name in CAUGHT]
)
def test_the_suite_fails_a_broken_front_end(driver: type[NativeDriver], name: str) -> None:
    with pytest.raises(AssertionError):
        run_suite_test(driver, name)


@pytest.mark.parametrize("name", sorted({name for _, name in CAUGHT}))
def test_the_same_suite_tests_pass_on_a_sound_front_end(name: str) -> None:
    run_suite_test(NativeDriver, name)
