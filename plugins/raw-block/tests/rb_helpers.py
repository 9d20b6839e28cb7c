"""Helpers of the raw_block tests: configs, adapters, a simulated crash (and, from
slot_helpers, what the dax tests use too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend
from slot_helpers import Arena, ZlibSerde, client, flip_byte, load, store

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.l2.adapter import BackendCloseFailed
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.l2 import make_keys

__all__ = [
    "Arena",
    "backend_of",
    "check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write",
    "client",
    "config",
    "crash",
    "flip_byte",
    "load",
    "open_raw",
    "store",
]

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
    with pytest.raises(BackendCloseFailed, match="checkpoint at close was not written"):
        adapter.close()  # a close without its checkpoint fails, as a crash's stop would


def check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write(cfg: RawBlockConfig) -> None:
    """A key stored with one serde chain, stored again with another, then a crash: the
    start-up checkpoint lists the older write and the slot scan finds the newer one.  The
    older record, of the chain no longer configured, must not make the key a miss."""
    (key,) = make_keys(1)
    zipped = open_raw(cfg, serde=(ZlibSerde(),))
    assert store(zipped, [key], [bytes(30_000)]) == [True]
    zipped.close()
    plain = open_raw(cfg)  # its start-up checkpoint lists the zlib write
    newer = b"new" * 10_000
    assert store(plain, [key], [newer]) == [True]
    crash(plain)  # the newer write is known from its slot header only
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        assert stats.get("serde_chain_mismatch", 0) == 0, "the superseded record was judged"
        assert client(reopened).lookup_and_lock([key]).found == [True]
        reopened.unlock([key])
        assert load(reopened, [key], [len(newer)]) == ([True], [newer])
        assert len(list(reopened.iter_keys())) == 1
    finally:
        reopened.close()
