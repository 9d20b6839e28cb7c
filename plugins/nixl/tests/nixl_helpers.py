"""Shared helpers of the NIXL plugin tests: scratch directories, configs, adapters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from lmcache_plugin_nixl.dynamic import NixlDynamicBackend
from lmcache_plugin_nixl.store import NixlStoreBackend

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.files import AlignedArena
from lmcache_tiers.testing.l2 import make_keys, pattern


def serve_refusal(adapters: list[dict[str, Any]], env: Mapping[str, str]) -> tuple[str, str]:
    """(the one ``error:`` line, all output) of ``serve`` with ``adapters``, which must
    refuse them at start-up (exit 2)."""
    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--l1-size-gb", "0.0625"]
    command += ["--port", "0", "--metrics-port", "0"]
    for adapter in adapters:
        command += ["--l2-adapter", json.dumps(adapter)]
    done = subprocess.run(command, env=dict(env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0], done.stderr + done.stdout


@contextmanager
def scratch_dir() -> Iterator[str]:
    """A directory removed with everything in it when the block ends."""
    path = tempfile.mkdtemp(prefix="lmcache-nixl-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pool_config(
    directory: str, pool_size: int = 8, *, direct_io: bool = False, **extra: Any
) -> NixlStoreConfig:
    raw = {
        "backend": "POSIX",
        "backend_params": {"file_path": directory, "use_direct_io": "true" if direct_io else "false"},
        "pool_size": pool_size,
        **extra,
    }
    return msgspec.convert(raw, NixlStoreConfig)


def dynamic_config(
    directory: str,
    *,
    capacity_gb: float = 1.0,
    shard_dirs: bool = False,
    direct_io: bool = False,
    persist_enabled: bool = True,
) -> NixlStoreDynamicConfig:
    raw = {
        "backend": "POSIX",
        "backend_params": {
            "file_path": directory,
            "use_direct_io": "true" if direct_io else "false",
            "max_capacity_gb": repr(capacity_gb),
            "shard_dirs": "true" if shard_dirs else "false",
        },
        "persist_enabled": persist_enabled,
    }
    return msgspec.convert(raw, NixlStoreDynamicConfig)


def context(config: Any, arena: memoryview | None, serde: tuple[Serde, ...] = ()) -> AdapterContext:
    return AdapterContext(index=0, name="0:nixl-test", config=config, serde=serde, l1_buffer=arena)


def _open(factory: Any, config: Any, facts: AdapterContext) -> BackendAdapter:
    adapter = create_adapter(factory, config, facts)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def open_pool(config: NixlStoreConfig, arena: memoryview | None = None) -> BackendAdapter:
    return _open(NixlStoreBackend, config, context(config, arena))


def open_dynamic(
    config: NixlStoreDynamicConfig, arena: memoryview | None = None, serde: tuple[Serde, ...] = ()
) -> BackendAdapter:
    return _open(NixlDynamicBackend, config, context(config, arena, serde))


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


Arena = AlignedArena


def lru_eviction_controller(adapter: L2Adapter, watermark: float, ratio: float) -> L2EvictionController:
    """The real per-adapter L2 eviction controller with the installed LRU policy.

    Tests call its ``evict`` directly (one cycle) instead of starting its thread.
    """
    config = L2EvictionConfig(eviction_policy="LRU", trigger_watermark=watermark, eviction_ratio=ratio)
    component = load_registry().get(Kind.EVICTION_POLICY, "LRU")
    policy = component.create(component.config())
    return L2EvictionController(AdapterSlot(0, "nixl", adapter), policy, config, EngineStats(1))


def still_open(identities: list[tuple[int, int]]) -> bool:
    """Whether every (descriptor, inode) still names its file (not closed, not reused)."""
    for fd, inode in identities:
        try:
            if os.fstat(fd).st_ino != inode:
                return False
        except OSError:
            return False
    return True


def hold_transfer(
    monkeypatch: Any,
    operation: str,
    entered: threading.Event,
    gate: threading.Event,
    *,
    then_raise: bool = False,
) -> None:
    """The first NIXL ``operation`` stays in progress until ``gate`` opens, then runs (or,
    ``then_raise``, raises as a failing transfer call would)."""
    from lmcache_plugin_nixl.runtime import NixlRuntime

    runtime = NixlRuntime.shared()
    transfer_many = runtime.transfer_many

    def held(backend_name: str, op: str, *args: object, **kwargs: object) -> object:
        if op == operation and not entered.is_set():
            entered.set()
            gate.wait(60)
            if then_raise:
                raise RuntimeError("injected: the transfer raised")
        return transfer_many(backend_name, op, *args, **kwargs)

    monkeypatch.setattr(runtime, "transfer_many", held)


@dataclass
class HeldCall:
    """A store or load of ``keys`` inside its first NIXL transfer, on thread ``call``."""

    adapter: Any
    backend: Any
    directory: str
    arena: AlignedArena
    keys: list[ObjectKey]
    call: threading.Thread
    gate: threading.Event
    raised: list[BaseException] = field(default_factory=list)

    def close_under_it(self) -> None:
        """What core does once its close deadline passed: closing flag, then backend close."""
        self.adapter.state.closing.set()
        self.backend.close()

    def let_it_leave(self) -> None:
        self.gate.set()
        self.call.join(30)
        assert not self.call.is_alive()


@contextmanager
def call_held_in_transfer(
    monkeypatch: Any,
    operation: str,
    open_adapter: Callable[[str, memoryview], Any],
    *,
    count: int = 1,
    seed: int = 90,
    then_raise: bool = False,
    before_call: Callable[[Any], None] | None = None,
) -> Iterator[HeldCall]:
    """An adapter opened on a scratch directory with an L1 arena, and a store (WRITE) or a
    load (READ, of keys stored first) of ``count`` arena payloads held inside its first
    NIXL transfer (:func:`hold_transfer`); ``before_call(backend)`` runs just before the
    call starts.  The call is let go and the adapter closed when the block ends."""
    arena = AlignedArena()
    entered, gate = threading.Event(), threading.Event()
    with scratch_dir() as directory:
        adapter = open_adapter(directory, arena.view)
        try:
            backend = adapter.backend
            keys = make_keys(count)
            # The payloads lie in the arena, as core's do.
            payloads = [arena.filled(pattern(seed + i, 64 << 10)) for i in range(count)]
            if operation == "READ":
                assert backend.put_many(keys, payloads) == [True] * count
                target, args = backend.get_many_into, (keys, [arena.take(64 << 10) for _ in keys])
            else:
                target, args = backend.put_many, (keys, payloads)
            held = HeldCall(adapter, backend, directory, arena, keys, threading.Thread(), gate)

            def run() -> None:
                try:
                    target(*args)
                except RuntimeError as exc:
                    held.raised.append(exc)

            held.call = threading.Thread(target=run, name="store" if operation == "WRITE" else "load")
            if before_call is not None:
                before_call(backend)
            hold_transfer(monkeypatch, operation, entered, gate, then_raise=then_raise)
            held.call.start()
            assert entered.wait(10)
            yield held
        finally:
            gate.set()
            adapter.close()
