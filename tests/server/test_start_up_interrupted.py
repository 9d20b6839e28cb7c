"""Start-up that does not finish: a signal while it runs, a storage that cannot be built.

Either way nothing it made may outlive it: the L1 segment in /dev/shm (gigabytes, and under
a given name never reaped), bound ports, descriptors of a process that goes on.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from tiers_e2e import HERE, free_port, stop_signals_at_default

from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry, reset_cache
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.server.app import TiersServer

LAUNCHER = HERE / "start_blocked_for_tests.py"


def _start_blocked(tmp_path: Path, shm_name: str) -> tuple[subprocess.Popen[str], Path]:
    """A server process whose start-up has made its L1 segment and blocks building L2."""
    blocked = tmp_path / "blocked"
    settings = {"l1_size_gb": 0.25, "port": free_port(), "metrics_port": 0, "l1_shm_name": shm_name}
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), json.dumps({"config": settings}), str(blocked)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LMCACHE_LOG_LEVEL": "INFO"},
        preexec_fn=stop_signals_at_default(),
    )
    deadline = time.monotonic() + 60
    while not blocked.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"start-up never reached the L2 adapter: {proc.communicate()}")
        time.sleep(0.02)
    return proc, blocked


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_during_start_up_stops_it_and_unlinks_the_segment(tmp_path: Path, sig: int) -> None:
    shm_name = f"tiers_test_{uuid.uuid4().hex[:12]}"
    segment = Path("/dev/shm") / shm_name
    proc, _ = _start_blocked(tmp_path, shm_name)
    try:
        assert segment.exists()  # L1 is made before the adapters
        proc.send_signal(sig)
        # The adapter would block for two minutes: the signal ends start-up at once.
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        exists = segment.exists()
        segment.unlink(missing_ok=True)
    name = signal.Signals(sig).name
    assert not exists, f"the L1 segment outlived a start-up interrupted by {name}"
    assert proc.returncode == 128 + sig, err
    assert f"start-up interrupted by {name}: stopped before serving" in err, err
    assert "Traceback" not in err, err


def test_a_storage_that_cannot_be_built_leaks_no_descriptors(tmp_path: Path) -> None:
    # TiersServer in this process, as a program embedding it (or retrying start-up) does.
    shm_name = f"tiers_test_{uuid.uuid4().hex[:12]}"
    taken = Path("/dev/shm") / shm_name
    taken.touch()
    try:
        registry = load_registry()
        overrides = {"l1_size_gb": 0.01, "port": free_port(), "metrics_port": 0, "l1_shm_name": shm_name}
        config = build_config(registry, overrides=overrides)
        # Collected first: garbage of earlier tests in this worker, collected while the loop
        # ran, closed its descriptors and made the count fall.
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(ConfigError, match="already exists"):
                TiersServer(config, registry=registry)
        gc.collect()  # descriptors that only wait for a collection are not leaked
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        taken.unlink()


class _NeedsSettings(msgspec.Struct):
    """A policy config with a field no flag can give."""

    window: int


@pytest.fixture
def own_registry() -> Iterator[ComponentRegistry]:
    """The discovered registry, for a test that adds components to it: discovered again
    after the test, so that what it added reaches no other test of this process (a
    command listing every eviction policy would meet one it cannot build)."""
    try:
        yield load_registry()
    finally:
        reset_cache()


def test_an_l2_eviction_policy_that_cannot_be_built_leaks_no_descriptors(
    own_registry: ComponentRegistry,
) -> None:
    # Built after L1, the adapters and the engine's controllers: each of those is given back.
    registry = own_registry
    registry.for_plugin(Kind.EVICTION_POLICY, "tests").add("needs_settings", object, _NeedsSettings)
    adapter = {"type": "mock", "max_size_gb": 0.01, "eviction": {"eviction_policy": "needs_settings"}}
    shm_name = f"tiers_test_{uuid.uuid4().hex[:12]}"
    overrides = {"l1_size_gb": 0.01, "port": free_port(), "metrics_port": 0, "l1_shm_name": shm_name}
    config = build_config(registry, overrides=overrides, adapter_json=[json.dumps(adapter)])
    gc.collect()  # descriptors that only wait for a collection are not leaked
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(ConfigError, match="needs configuration it cannot get from a flag"):
            TiersServer(config, registry=registry)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    assert not (Path("/dev/shm") / shm_name).exists()
