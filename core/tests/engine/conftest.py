from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.threads import new_threads  # noqa: F401 (a fixture)

# Helpers shared by the engine tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

from engine_support import GatedStorePolicy, make_storage

CONTROLLER_THREAD_PREFIXES = ("l1-eviction", "l2-store", "l2-prefetch", "l2-eviction-")


def controller_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(CONTROLLER_THREAD_PREFIXES)]


@pytest.fixture
def engine() -> Iterator[Callable[..., StorageManager]]:
    """Factory of StorageManagers that are closed (and their threads checked) afterwards."""
    built: list[StorageManager] = []

    def build(*args: Any, **kwargs: Any) -> StorageManager:
        storage = make_storage(*args, **kwargs)
        built.append(storage)
        return storage

    yield build
    GatedStorePolicy.gate.set()  # a test that failed midway must not leave the store controller parked
    for storage in built:
        for adapter in storage.adapters:
            backend = getattr(adapter, "backend", adapter)
            for gate_name in ("gate", "store_gate"):
                gate = getattr(backend, gate_name, None)
                if gate is not None:
                    gate.set()  # a test that failed midway must not leave a task parked
        storage.close()
    assert controller_threads() == [], "a controller thread outlived close()"
