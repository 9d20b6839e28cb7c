"""Helpers of the raw_block tests: configs, adapters, a simulated crash (and, from
slot_helpers, what the dax tests use too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend
from slot_helpers import Arena, client, flip_byte, load, store

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde

__all__ = ["Arena", "backend_of", "client", "config", "crash", "flip_byte", "load", "open_raw", "store"]

SLOT = 64 << 10
HEADER = 4096
PAYLOAD = SLOT - HEADER


def config(path: Path | str, slots: int = 16, *, slot_bytes: int = SLOT, **extra: Any) -> RawBlockConfig:
    """A config whose device holds exactly ``slots`` slots (metadata sized by the adapter)."""
    meta = 4096 + 2 * (64 << 10)  # the adapter's sizing for up to 120 slots
    assert slots <= 120
    return RawBlockConfig(
        device_path=str(path), slot_bytes=slot_bytes, capacity_bytes=meta + slots * slot_bytes, **extra
    )


def open_raw(cfg: RawBlockConfig, serde: tuple[Serde, ...] = ()) -> BackendAdapter:
    adapter = create_adapter(
        RawBlockBackend, cfg, AdapterContext(index=0, name="0:raw_block", config=cfg, serde=serde)
    )
    assert isinstance(adapter, BackendAdapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> RawBlockBackend:
    backend = adapter.backend
    assert isinstance(backend, RawBlockBackend)
    return backend


def crash(adapter: BackendAdapter) -> None:
    """End the adapter the way a killed process leaves the device: no final checkpoint.

    Nothing is in flight when it is called, so what is on the device is exactly what a
    SIGKILL at this moment leaves there; the real kill is in test_crash.
    """
    backend_of(adapter).checkpoint = lambda force=False: False  # type: ignore[method-assign]
    adapter.close()
