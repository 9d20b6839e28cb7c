"""Conformance suite every front end passes (``FrontendSuite``).

A front end's tests subclass :class:`FrontendSuite`, set ``component_name`` (and
``frontend_options`` for its config) and implement :meth:`FrontendSuite.make_driver`: a
:class:`FrontendDriver` that speaks the front end's protocol in the few terms the suite
needs -- store the chunks of request *n*, look them up, retrieve them, hold locks like a
client that vanished.  The suite runs the front end over a real StorageManager (L1 only)
built the way the server builds it, and checks what every front end owes the server: it
serves the address it reports, stores and reads the right bytes, counts what it does,
keeps serving after garbage, reports status and health, refuses an address in use, and
gives back every lock and reservation its clients hold when it stops.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import zmq

from lmcache_tiers.config import FrontendConfig, ServerConfig, build_config
from lmcache_tiers.frontend import Frontend, FrontendStats, create_frontend
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.base import ComponentSuite
from lmcache_tiers.testing.ports import free_port

__all__ = ["FrontendDriver", "FrontendSuite", "store_keys_accounted"]

#: messages no protocol takes for a request
JUNK: list[list[bytes]] = [
    [b""],
    [b"\x00"],
    [b"\xc1" * 7],
    [b"\x91" * 50_000 + b"\xc0"],
    [b"x", b"", b"\xff" * 300],
]


class FrontendDriver(ABC):
    """A client of the front end under test, in the suite's terms.

    Requests are numbered; request ``n``'s chunks are whatever the protocol derives from
    ``n`` (its tokens, its keys), the same on every call.
    """

    #: bytes of one chunk object
    chunk_bytes: ClassVar[int] = 64 << 10

    @abstractmethod
    def store(self, request: int, chunks: list[bytes]) -> bool:
        """Store the first ``len(chunks)`` chunks of ``request``; True when all were stored."""

    @abstractmethod
    def lookup(self, request: int, count: int) -> int:
        """How many leading chunks of the first ``count`` of ``request`` are cached.  Locks
        the lookup takes are released by the retrieve, or before this returns when the
        protocol lets a client do so."""

    @abstractmethod
    def retrieve(self, request: int, count: int) -> list[bytes] | None:
        """The bytes of the first ``count`` chunks of ``request``, None on a miss -- of any
        of them: a retrieve the front end answers with fewer chunks is one; holds nothing
        afterwards."""

    @abstractmethod
    def hold(self, request: int, count: int) -> None:
        """Take read locks on request ``request``'s stored chunks and reserve the chunks of
        request ``request + 1``, and never give either back (a client that vanished)."""

    @abstractmethod
    def alive(self) -> bool:
        """A trivial request is answered."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection."""


def store_keys_accounted(stats: FrontendStats) -> int:
    """The store keys a front end's counters account for: stored, skipped and refused.
    Every key a store names is one of these, once, however its request ended."""
    return (
        stats.store_chunks + sum(stats.store_keys_skipped.values()) + sum(stats.store_keys_refused.values())
    )


def payloads(request: int, count: int, size: int) -> list[bytes]:
    """Distinct, deterministic bytes for the chunks of one request: pseudo-random, so a
    front end that reorders, swaps or shifts bytes within a chunk does not read back equal."""
    return [
        np.random.default_rng([request, index]).integers(0, 256, size, dtype=np.uint8).tobytes()
        for index in range(count)
    ]


class FrontendSuite(ComponentSuite):
    kind = Kind.FRONTEND
    #: the front end's config (without "type")
    frontend_options: ClassVar[dict[str, Any]] = {}

    @abstractmethod
    def make_driver(self, frontend: Frontend) -> FrontendDriver:
        """A client connected to ``frontend.address``."""

    # -- fixtures ------------------------------------------------------------------------

    def _server_config(self, **frontend: Any) -> ServerConfig:
        spec = {"type": self.component_name, **self.frontend_options, **frontend}
        return build_config(
            load_registry(),
            overrides={
                "l1_size_gb": 0.0625,
                "port": 0,
                "metrics_port": 0,
                "l1_shm_name": f"tiers_fe_{uuid.uuid4().hex[:12]}",
            },
            frontend_json=[json.dumps(spec)],
        )

    def _create(self, storage: StorageManager, config: ServerConfig) -> Frontend:
        def fatal(exc: BaseException) -> None:
            raise AssertionError(f"the front end reported a fatal error: {exc}")

        return create_frontend(
            load_registry(),
            0,
            config.frontends[0],
            storage,
            config,
            auth_token=None,
            drain_timeout_s=5.0,
            status=lambda: {"server": {}},
            fatal=fatal,
        )

    @pytest.fixture
    def storage(self) -> Iterator[StorageManager]:
        config = self._server_config()
        manager = StorageManager(config, load_registry())
        yield manager
        manager.close(drain_timeout_s=0.0)

    @pytest.fixture
    def frontend(self, storage: StorageManager) -> Iterator[Frontend]:
        built = self._create(storage, storage.config)
        built.start()
        yield built
        built.stop(force=True)
        assert built.join(30), "the front end did not stop"

    @pytest.fixture
    def driver(self, frontend: Frontend) -> Iterator[FrontendDriver]:
        connected = self.make_driver(frontend)
        yield connected
        connected.close()

    # -- the suite -----------------------------------------------------------------------

    def test_config_subclasses_frontend_config(self) -> None:
        assert issubclass(self.registered_component().config, FrontendConfig)

    def test_serves_the_address_it_reports(self, frontend: Frontend, driver: FrontendDriver) -> None:
        assert frontend.address.startswith("tcp://127.0.0.1:")
        assert not frontend.address.endswith((":0", ":*"))
        assert driver.alive()

    def test_stored_chunks_read_back_equal(self, storage: StorageManager, driver: FrontendDriver) -> None:
        chunks = payloads(1, 3, driver.chunk_bytes)
        assert driver.store(1, chunks)
        l1 = storage.status()["l1"]
        assert l1["objects"] == 3
        assert l1["write_locked"] == 0, "a completed store left chunks reserved"
        assert driver.lookup(1, 3) == 3
        assert driver.retrieve(1, 3) == chunks
        assert storage.status()["l1"]["read_locks"] == 0

    def test_requests_read_back_their_own_chunks(
        self, storage: StorageManager, driver: FrontendDriver
    ) -> None:
        # Two requests of the same length: a front end that derives keys from less than
        # the request (its length, a chunk's position) serves one request's bytes for the
        # other, or finds chunks of a request never stored.
        first, second = payloads(5, 2, driver.chunk_bytes), payloads(6, 2, driver.chunk_bytes)
        assert driver.store(5, first)
        assert driver.lookup(6, 2) == 0, "a request never stored was found"
        assert driver.retrieve(6, 2) is None
        assert driver.store(6, second)
        assert storage.status()["l1"]["objects"] == 4
        assert driver.retrieve(5, 2) == first
        assert driver.retrieve(6, 2) == second
        l1 = storage.status()["l1"]
        assert (l1["read_locks"], l1["write_locked"]) == (0, 0)

    def test_a_miss_is_a_miss(self, storage: StorageManager, driver: FrontendDriver) -> None:
        assert driver.lookup(99, 2) == 0
        assert driver.retrieve(99, 2) is None
        assert driver.store(2, payloads(2, 1, driver.chunk_bytes))
        assert driver.lookup(2, 2) == 1  # the prefix only
        # Only the first chunk is there: the second must not be made up (nor the request
        # answered with the one chunk, as if it were the two asked for).
        assert driver.retrieve(2, 2) is None, "a retrieve of a partly stored request was answered"
        assert storage.status()["l1"]["read_locks"] == 0

    def test_stats_count_what_it_did(self, frontend: Frontend, driver: FrontendDriver) -> None:
        assert driver.store(3, payloads(3, 2, driver.chunk_bytes))
        assert driver.retrieve(3, 2) is not None
        stats = frontend.stats()
        assert sum(stats.requests.values()) >= 3
        assert (stats.store_chunks, stats.retrieve_chunks) == (2, 2)
        assert (stats.store_bytes, stats.retrieve_bytes) == (2 * driver.chunk_bytes, 2 * driver.chunk_bytes)

    def test_status_is_json_and_health_is_ok(self, frontend: Frontend, driver: FrontendDriver) -> None:
        driver.alive()
        status = frontend.status()
        assert json.loads(json.dumps(status))["address"] == frontend.address
        assert status["type"] == self.component_name and status["name"] == frontend.name
        assert frontend.health() == (True, "ok")
        description = frontend.describe()
        assert description and "\n" not in description

    def test_garbage_does_not_stop_it(self, frontend: Frontend, driver: FrontendDriver) -> None:
        context = zmq.Context()
        try:
            rogue = context.socket(zmq.DEALER)
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(frontend.address)
            for frames in JUNK:
                rogue.send_multipart(frames)
            rogue.close(0)
        finally:
            context.term()
        assert driver.alive()
        assert frontend.health()[0]

    def test_stopping_gives_back_what_clients_hold(
        self, storage: StorageManager, frontend: Frontend, driver: FrontendDriver
    ) -> None:
        assert driver.store(4, payloads(4, 2, driver.chunk_bytes))
        driver.hold(4, 2)
        before = storage.status()["l1"]
        assert before["read_locks"] > 0 and before["write_locked"] > 0
        frontend.stop()
        assert frontend.join(30)
        after = storage.status()["l1"]
        assert (after["read_locks"], after["write_locked"]) == (0, 0)
        stats = frontend.stats()
        assert stats.released_at_stop_locks > 0 and stats.released_at_stop_reservations > 0
        healthy, reason = frontend.health()
        assert not healthy and reason

    def test_an_address_in_use_is_refused(self, storage: StorageManager, frontend: Frontend) -> None:
        port = int(frontend.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="cannot listen"):
            self._create(storage, self._server_config(port=port))

    def test_a_front_end_never_started_closes_on_join(self, storage: StorageManager) -> None:
        port = free_port()  # nothing listens there, and no one else takes it
        built = self._create(storage, self._server_config(port=port))
        built.stop()
        assert built.join(10)
        deadline = time.monotonic() + 5
        while True:  # the port is free again
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the front end still holds its port"
                    time.sleep(0.05)
