"""Shared helpers of the fs plugin tests: configs, adapters, arenas, files on disk."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
from lmcache_plugin_fs import FsConfig
from lmcache_plugin_fs.backend import FsBackend

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.files import AlignedArena, flip_byte, load_data, store_data

HEADER = 4096


def fs_config(root: str, **fields: Any) -> FsConfig:
    return msgspec.convert({"path": root, **fields}, FsConfig)


def open_fs(
    config: FsConfig, arena: memoryview | None = None, serde: tuple[Serde, ...] = ()
) -> BackendAdapter:
    facts = AdapterContext(index=0, name="0:fs-test", config=config, serde=serde, l1_buffer=arena)
    adapter = create_adapter(FsBackend, config, facts)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def fs_backend(adapter: BackendAdapter) -> FsBackend:
    """The fs backend of ``adapter``: behind core's circuit breaker for an fsspec URL."""
    backend = getattr(adapter.backend, "inner", adapter.backend)
    assert isinstance(backend, FsBackend)
    return backend


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


Arena = AlignedArena


store = store_data
load = load_data
__all__ = [
    "HEADER",
    "Arena",
    "client",
    "flip_byte",
    "fs_backend",
    "fs_config",
    "load",
    "open_fs",
    "payload_bytes_on_disk",
    "record_files",
    "store",
]


def record_files(root: str) -> list[str]:
    """Every record file under root, relative to it."""
    return sorted(
        os.path.relpath(os.path.join(directory, name), root)
        for directory, _dirs, files in os.walk(root)
        for name in files
        if name.endswith(".bin")
    )


def payload_bytes_on_disk(root: str) -> int:
    return sum(os.path.getsize(os.path.join(root, path)) - HEADER for path in record_files(root))


@contextlib.contextmanager
def closed_past_a_stuck_call(
    adapter: BackendAdapter,
    gate: threading.Event,
    closed: threading.Event,
    threads: str | tuple[str, ...],
    what: str,
) -> Iterator[None]:
    """Close ``adapter`` past a 0.2 s deadline, on a thread, while one of its calls is stuck
    until ``gate`` is set, and assert that close returned anyway (``closed`` is set then).
    The body runs after that, the stuck call still stuck; then the call is let go and the
    threads whose names start with ``threads`` are waited for, as the call ends."""

    def close() -> None:
        adapter.close()
        closed.set()

    closer = threading.Thread(target=close, daemon=True)
    adapter.close_timeout_s = 0.2  # type: ignore[misc]
    closer.start()
    try:
        closer.join(10)
        assert closed.is_set(), f"close waited for a {what} stuck in storage"
        yield
        gate.set()
        for thread in threading.enumerate():  # the call ends once its stuck step returns
            if thread.name.startswith(threads):
                thread.join(30)
    finally:
        gate.set()
        closer.join(30)
