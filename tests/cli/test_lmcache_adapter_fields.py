"""LMCache's ``--l2-adapter`` JSON fields: each is taken with its meaning or refused in one
line naming it and saying it is not supported (never ignored, never a different unit)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

FS = {"type": "fs", "path": "/tmp/lmcache-tiers-unused"}
RAW_BLOCK = {"type": "raw_block", "device_path": "/tmp/rb", "slot_bytes": 1 << 20, "capacity_bytes": 1 << 30}
DAX = {"type": "dax", "slot_bytes": 4096, "device_path": "/tmp/dax", "max_dax_size_gb": 1}
MOONCAKE = {"type": "mooncake_store", "metadata_server": "http://10.0.0.1:8080/metadata"}
NIXL_STORE = {
    "type": "nixl_store",
    "backend": "POSIX",
    "pool_size": 4,
    "backend_params": {"file_path": "/tmp/nixl-unused", "use_direct_io": "false"},
}


def decode(spec: dict[str, Any]) -> Any:
    return decode_adapter(load_registry(), spec, 0).config


def refusal(spec: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        decode(spec)
    return str(caught.value)


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({**FS, "shared": True}, "shared", "coordinator"),
        ({**FS, "per_op_workers": {"store": 2}}, "per_op_workers", "num_workers"),
        ({**FS, "affinity_tag": "gpu0"}, "affinity_tag", "one L1"),
        ({"type": "s3", "bucket": "b", "s3_prefer_http2": True}, "s3_prefer_http2", "HTTP/2"),
        ({"type": "s3", "bucket": "b", "s3_num_io_threads": 64}, "s3_num_io_threads", "max_inflight"),
        ({"type": "s3", "bucket": "b", "s3_enable_s3express": True}, "s3_enable_s3express", "Express"),
        ({"type": "valkey", "startup_nodes": "h:1", "ttl_seconds": 60}, "ttl_seconds", "expiry"),
        ({**RAW_BLOCK, "io_engine": "io_uring"}, "io_engine", "io_uring"),
        ({**RAW_BLOCK, "fdp_enabled": True}, "fdp_enabled", "placement"),
        ({**RAW_BLOCK, "persist_enabled": False}, "persist_enabled", "always kept"),
        ({**DAX, "hotplug_enabled": True}, "hotplug_enabled", "fixed at start-up"),
        # Mooncake's own set-up keys, which LMCache's adapter forwards to Mooncake
        ({**MOONCAKE, "rdma_devices": "mlx5_0"}, "rdma_devices", "TCP"),
        ({**MOONCAKE, "device_name": "mlx5_0"}, "device_name", "TCP"),
        ({**MOONCAKE, "ipc_socket_path": "/run/mc.sock"}, "ipc_socket_path", "client of its own"),
        ({**MOONCAKE, "enable_ssd_offload": True}, "enable_ssd_offload", "SSD offload"),
        ({**MOONCAKE, "ssd_offload_path": "/ssd"}, "ssd_offload_path", "SSD offload"),
        ({**MOONCAKE, "tenant_id": "team-a"}, "tenant_id", "key_prefix"),
        ({**MOONCAKE, "enable_client_http_server": True}, "enable_client_http_server", "/metrics"),
        ({**MOONCAKE, "client_http_port": 9400}, "client_http_port", "/metrics"),
        # values compare as JSON values: 0 and "false" are not false, 1 is not true
        ({**MOONCAKE, "enable_ssd_offload": 0}, "enable_ssd_offload", "SSD offload"),
        ({**MOONCAKE, "enable_ssd_offload": "false"}, "enable_ssd_offload", "SSD offload"),
        ({**RAW_BLOCK, "persist_enabled": 1}, "persist_enabled", "always kept"),
        # LMCache reads persist_enabled from every adapter; one without the choice refuses "false"
        ({"type": "mock", "persist_enabled": False}, "persist_enabled", "nothing to persist"),
        ({"type": "s3", "bucket": "b", "persist_enabled": False}, "persist_enabled", "up to its backend"),
        # LMCache's default true asks for records found again after a restart: these lose them
        ({"type": "mock", "persist_enabled": True}, "persist_enabled", "this process's memory"),
        ({**NIXL_STORE, "persist_enabled": True}, "persist_enabled", "nothing is found again"),
    ],
)
def test_an_lmcache_field_without_equivalent_is_refused_naming_it_and_why(
    spec: dict[str, Any], field: str, reason: str
) -> None:
    message = refusal(spec)
    assert f"unknown field `{field}`: this LMCache field is not supported by {spec['type']}" in message
    assert reason in message
    assert message.endswith("- at `$.l2_adapters[0]`")
    assert "\n" not in message


def test_a_field_nobody_knows_is_refused_as_not_supported() -> None:
    message = refusal({**FS, "bogus": 1})
    assert "unknown field `bogus`: not supported by fs" in message
    assert "plugins reference" in message


def test_an_unknown_field_inside_a_nested_object_is_not_taken_for_an_lmcache_one() -> None:
    message = refusal({**FS, "eviction": {"shared": True}})
    assert "unknown field `shared`: not supported by fs" in message
    assert message.endswith("- at `$.l2_adapters[0].eviction`")


# Mooncake's own defaults for its set-up keys, which LMCache's adapter forwards
MOONCAKE_DEFAULTS = {"rdma_devices": "", "device_name": "", "ipc_socket_path": "", "tenant_id": "default"}
MOONCAKE_FEATURES_OFF = {
    "enable_ssd_offload": False,
    "ssd_offload_path": "",
    "enable_client_http_server": False,
    "client_http_port": 9300,
}


@pytest.mark.parametrize(
    ("base", "neutral"),
    [
        (FS, {"affinity_tag": "_default"}),
        (RAW_BLOCK, {"persist_enabled": True}),
        (MOONCAKE, {**MOONCAKE_DEFAULTS, **MOONCAKE_FEATURES_OFF}),
        # null is LMCache's "not set" (its mooncake adapter skips such keys)
        (MOONCAKE, {"rdma_devices": None, "tenant_id": None}),
        (FS, {"shared": None, "per_op_workers": None}),
        # LMCache's defaults of the fields it reads from every adapter object
        (FS, {"shared": False}),
        ({"type": "mock"}, {"shared": False, "affinity_tag": "_default", "persist_enabled": None}),
        # their records outlive a restart of the server, as long as their backend keeps them
        ({"type": "s3", "bucket": "b"}, {"persist_enabled": True}),
        ({"type": "redis", "host": "h"}, {"persist_enabled": True}),
        (MOONCAKE, {"persist_enabled": True}),
        ({"type": "valkey", "startup_nodes": "h:1"}, {"persist_enabled": None}),
    ],
)
def test_lmcache_fields_holding_what_is_done_here_anyway_are_accepted(
    base: dict[str, Any], neutral: dict[str, Any]
) -> None:
    assert decode({**base, **neutral}) == decode(base)


@pytest.mark.parametrize("persist", [True, False])
def test_an_adapter_with_its_own_persist_enabled_keeps_the_value_given(persist: bool) -> None:
    assert decode({**FS, "persist_enabled": persist}).persist_enabled is persist
    # null is no value for a field the adapter has: refused, not taken for its default
    assert "persist_enabled" in refusal({**FS, "persist_enabled": None})


def test_lmcaches_fp8_max_workers_is_refused_saying_why() -> None:
    message = refusal({**FS, "serde": {"type": "fp8", "max_workers": 4}})
    assert "unknown field `max_workers`: this LMCache field is not supported by fp8" in message
    assert "adapter's worker threads" in message
    assert message.endswith("- at `$.l2_adapters[0].serde[0]`")
    # null is LMCache's "not set"
    fp8 = {"type": "fp8"}
    assert decode({**FS, "serde": {**fp8, "max_workers": None}}) == decode({**FS, "serde": fp8})


def test_lmcache_mock_bandwidth_is_gib_per_second() -> None:
    config = decode({"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 2})
    assert config.bandwidth_bytes_per_s == 2 << 30


def test_mock_bandwidth_given_both_ways_must_agree() -> None:
    agreeing = {"type": "mock", "mock_bandwidth_gb": 0.5, "bandwidth_bytes_per_s": 1 << 29}
    assert decode(agreeing).bandwidth_bytes_per_s == 1 << 29
    message = refusal({"type": "mock", "mock_bandwidth_gb": 2, "bandwidth_bytes_per_s": 5})
    assert "give one of the two" in message
    assert message.endswith("- at `$.l2_adapters[0].mock_bandwidth_gb`")


def test_a_printed_mock_config_with_lmcache_bandwidth_reads_back_equal() -> None:
    config = decode({"type": "mock", "mock_bandwidth_gb": 1.5})
    assert decode({"type": "mock", **msgspec.to_builtins(config)}) == config


@pytest.mark.parametrize("type_name", ["resp", "valkey", "redis"])
def test_redis_connection_timeout_defaults_to_lmcache_valkeys(type_name: str) -> None:
    assert decode({"type": type_name, "host": "h", "port": 6379}).connection_timeout == 10.0
