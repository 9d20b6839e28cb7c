"""Two mock adapters of one server sharing a namespace: refused before the server starts."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.preflight import preflight_adapters
from lmcache_tiers.plugins import load_registry


def preflight(*specs: dict[str, Any]) -> None:
    registry = load_registry()
    preflight_adapters(registry, build_config(registry, {"l2_adapters": list(specs)}))


def test_two_adapters_of_one_server_naming_one_namespace_are_refused() -> None:
    # Each would account and evict the other's objects as its own.
    namespace = uuid.uuid4().hex
    with pytest.raises(
        ConfigError,
        match=rf"^mock: mock namespace '{namespace}' is already used by another adapter of this "
        r"server; .* - at `\$\.l2_adapters\[1\]\.namespace`$",
    ):
        preflight({"type": "mock", "namespace": namespace}, {"type": "mock", "namespace": namespace})


def test_a_wrapped_adapter_counts_as_one_of_the_server() -> None:
    namespace = uuid.uuid4().hex
    wrapped = {"type": "fault_inject", "inner": {"type": "mock", "namespace": namespace}}
    with pytest.raises(ConfigError, match=r" - at `\$\.l2_adapters\[1\]\.inner\.namespace`$"):
        preflight({"type": "mock", "namespace": namespace}, wrapped)


def test_distinct_namespaces_and_none_at_all_pass() -> None:
    preflight(
        {"type": "mock", "namespace": uuid.uuid4().hex},
        {"type": "mock", "namespace": uuid.uuid4().hex},
        {"type": "mock"},
        {"type": "mock"},
    )
    # each check stands alone: the namespace of one config is free for the next
    namespace = uuid.uuid4().hex
    preflight({"type": "mock", "namespace": namespace})
    preflight({"type": "mock", "namespace": namespace})


def test_a_prefaulted_pool_larger_than_the_memory_available_is_refused() -> None:
    # Touched whole at open, a pool past the memory available would set off the OOM killer.
    with pytest.raises(
        ConfigError,
        match=r"^mock: prefault would touch [\d.]+ GiB .* more than the [\d.]+ GiB of memory available "
        r"\(MemAvailable\); .* - at `\$\.l2_adapters\[0\]\.max_size_gb`$",
    ):
        preflight({"type": "mock", "max_size_gb": 1 << 20, "prefault": True})
    # not touched until written, it is no more than address space
    preflight({"type": "mock", "max_size_gb": 1 << 20})
    preflight({"type": "mock", "max_size_gb": 0.01, "prefault": True})
