"""The ``mooncake_store`` config: LMCache's field names and size forms, refusals with their
path, and no credentials anywhere a config is printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.config import parse_size

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry


def decode(**fields: object) -> MooncakeStoreConfig:
    spec = decode_adapter(load_registry(), {"type": "mooncake_store", **fields}, 0)
    assert isinstance(spec.config, MooncakeStoreConfig)
    return spec.config


def test_lmcache_field_names_and_string_sizes_are_accepted() -> None:
    # As LMCache's mooncake_store adapter is configured (every value a string there).
    config = decode(
        local_hostname="10.0.0.5",
        metadata_server="http://10.0.0.1:8080/metadata",
        master_server_address="10.0.0.1:50051",
        protocol="tcp",
        global_segment_size="3355443200",
        local_buffer_size="1073741824",
        num_workers=8,
    )
    assert (config.segment_bytes, config.local_buffer_bytes) == (3355443200, 1 << 30)
    assert config.num_workers == 8
    assert config.capacity_bytes is None, "max_capacity_gb 0: no limit of its own"


def test_mooncakes_own_name_for_the_master_is_an_alias() -> None:
    # LMCache's multi-process server forwards the adapter's keys to Mooncake's set-up as
    # written, where the master is `master_server_addr`.
    config = decode(master_server_addr="10.0.0.1:50051")
    assert config.master_server_address == "10.0.0.1:50051"
    assert config == decode(master_server_address="10.0.0.1:50051"), "folded into the canonical field"
    assert decode(master_server_addr="10.0.0.1:50051", master_server_address="10.0.0.1:50051") == config
    printed = msgspec.to_builtins(config)
    assert printed["master_server_addr"] is None, "a printed config names the master once"
    assert decode(**printed) == config, "a printed config reads back"
    edited = decode(**{**printed, "master_server_address": "10.0.0.9:50051"})
    assert edited.master_server_address == "10.0.0.9:50051", "and can be edited"
    assert msgspec.structs.replace(config, num_workers=2).master_server_address == "10.0.0.1:50051"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("4GB", 4 << 30),
        ("512 MiB", 512 << 20),
        ("16mb", 16 << 20),
        ("1 t", 1 << 40),
    ],
)
def test_sizes(text: int | str, size: int) -> None:
    assert parse_size(text, "global_segment_size") == size


@pytest.mark.parametrize("size", [0, "16MiB", 16 << 20, "3355443200"])
def test_segments_of_none_or_of_mooncakes_smallest_size_and_more_are_accepted(size: int | str) -> None:
    assert decode(global_segment_size=size).global_segment_size == size


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"global_segment_size": "lots"}, r"\$\.l2_adapters\[0\]\.global_segment_size"),
        ({"local_buffer_size": -1}, "local_buffer_size"),
        ({"global_segment_size": "1KB"}, r"'1KB' is under Mooncake's smallest segment, 16MiB"),
        ({"global_segment_size": (16 << 20) - 1}, r"global_segment_size`"),
        ({"global_segment_size": "99999999999999999999"}, r"more bytes than Mooncake takes"),
        ({"local_buffer_size": 1 << 64}, r"more bytes than Mooncake takes.*local_buffer_size`"),
        ({"protocol": "rdma"}, "protocol"),
        ({"num_workers": 0}, "num_workers"),
        ({"operation_timeout_s": 0}, "operation_timeout_s"),
        ({"max_capacity_gb": -1}, "max_capacity_gb"),
        ({"master_server_address": "no-port"}, "master_server_address"),
        ({"master_server_address": "10.0.0.1:99999"}, r"'10.0.0.1:99999': the port is not 1..65535"),
        ({"master_server_addr": "10.0.0.1:0"}, r"the port is not 1..65535 - at .*\.master_server_addr`"),
        ({"master_server_addr": "no-port"}, r"\.master_server_addr`"),
        (
            {"master_server_addr": "10.0.0.1:50051", "master_server_address": "10.0.0.2:50051"},
            "master_server_addr '10.0.0.1:50051' contradicts",
        ),
        ({"key_prefix": "has space"}, "key_prefix"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"master_metrics_url": "ftp://x"}, "master_metrics_url"),
        ({"eviction": {"eviction_policy": "LRU"}}, "eviction.*max_capacity_gb"),
        ({"per_op_workers": {"store": 2}}, "unknown field"),
    ],
)
def test_bad_values_are_refused_with_their_path(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        decode(**fields)


def test_an_address_that_is_not_host_port_is_echoed_only_when_it_holds_nothing_else() -> None:
    with pytest.raises(ConfigError, match="'no-port' is not host:port"):
        decode(master_server_addr="no-port")
    with pytest.raises(ConfigError, match="the value given is not host:port") as caught:
        decode(master_server_addr="10.0.0.1:50051?token=hunter2")
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    "value",
    [
        "http://10.0.0.1:8080/metadata",
        "https://meta.example:443/metadata",
        "etcd://10.0.0.1:2379",
        "etcd://10.0.0.1:2379,10.0.0.2:2379",
        "redis://10.0.0.1:6379",
        "10.0.0.1:2379",
        "10.0.0.1:2379;10.0.0.2:2379",
        "P2PHANDSHAKE",
    ],
)
def test_every_kind_of_metadata_service_mooncake_reaches_is_accepted(value: str) -> None:
    assert decode(metadata_server=value).metadata_server == value


@pytest.mark.parametrize(
    ("value", "match"),
    [
        # Each was retried by Mooncake at every set-up attempt, ~10 s apiece, before failing.
        ("127.0.0.1:8080/metadata", "'127.0.0.1:8080/metadata' is neither a URL"),
        ("http//127.0.0.1:8080/metadata", "'http//127.0.0.1:8080/metadata' is neither a URL"),
        ("localhost", "'localhost' is neither a URL"),
        ("htp://127.0.0.1:8080/metadata", "the scheme is not one of http, https, etcd, redis"),
        ("http:///metadata", "is a URL without a host"),
        # Mooncake matched the scheme as written and aborted the process on these.
        ("HTTP://127.0.0.1:8080/metadata", "the scheme is not one of http, https, etcd, redis"),
        (" http://127.0.0.1:8080/metadata", "holds a space or a line break"),
        ("http://127.0.0.1:8080/metadata\n", "holds a space or a line break"),
        # These were accepted, then reported as a metadata server not answering.
        ("http://127.0.0.1:99999/metadata", "is not a valid URL"),
        ("http://127.0.0.1:port/metadata", "is not a valid URL"),
        ("http://127.0.0.1:0/metadata", "the port is not 1..65535"),
        ("10.0.0.1:2379,10.0.0.2:99999", "a port is not 1..65535"),
        # etcd's client took these as endpoints, stalling each set-up attempt ~5 s.
        ("etcd://127.0.0.1", "etcd:// takes host:port endpoints"),
        ("etcd://127.0.0.1:2379/metadata", "etcd:// takes host:port endpoints"),
        # urlsplit's own error named no field.
        ("http://[::1/metadata", "is not a valid URL"),
    ],
)
def test_a_metadata_server_mooncake_cannot_reach_is_refused_by_name(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        decode(metadata_server=value)
    assert str(caught.value).endswith("metadata_server`")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("http://", "is a URL without a host"),
        ("http://[::1", "is not a valid URL"),
        ("http://127.0.0.1:99999", "is not a valid URL"),
        ("HTTP://127.0.0.1:9003", "is not an http"),
    ],
)
def test_a_master_metrics_url_without_a_host_and_port_is_refused_by_name(value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        decode(master_metrics_url=value)
    assert str(caught.value).endswith("master_metrics_url`")


@pytest.mark.parametrize(
    "fields",
    [
        {"metadata_server": "http://admin:hunter2@10.0.0.1:8080/metadata"},
        {"metadata_server": "redis://:hunter2@10.0.0.1:6379"},
        {"master_server_address": "admin:hunter2@10.0.0.1:50051"},
        {"master_server_addr": "admin:hunter2@10.0.0.1:50051"},
        {"master_metrics_url": "http://admin:hunter2@10.0.0.1:9003"},
    ],
)
def test_credentials_are_refused_without_being_echoed(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="credentials are not accepted") as caught:
        decode(**fields)
    assert "hunter2" not in str(caught.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )


def test_print_config_and_plugins_show_print_no_credentials() -> None:
    leaky = json.dumps({"type": "mooncake_store", "metadata_server": "http://u:hunter2@h:8080/metadata"})
    refused = _cli("serve", "--l2-adapter", leaky, "--print-config")
    assert refused.returncode == 2, refused.stderr
    assert "credentials are not accepted" in refused.stderr
    assert "hunter2" not in refused.stdout + refused.stderr

    adapter = {
        "type": "mooncake_store",
        "metadata_server": "http://h:8080/metadata",
        "global_segment_size": "1GB",
    }
    printed = _cli("serve", "--l2-adapter", json.dumps(adapter), "--print-config")
    assert printed.returncode == 0, printed.stderr
    (shown,) = json.loads(printed.stdout)["l2_adapters"]
    assert shown["metadata_server"] == "http://h:8080/metadata"
    assert shown["global_segment_size"] == "1GB"

    show = _cli("plugins", "show", "mooncake_store")
    assert show.returncode == 0, show.stderr
    assert "master_server_address" in show.stdout and "credentials are not accepted" in " ".join(
        show.stdout.lower().split()
    )
