"""LMCache's ``resp`` and ``valkey`` JSON means here what it means in LMCache 0.5.6.

Its ``valkey`` adapter names an object ``<key_prefix>@<key>`` (the bare key when
``key_prefix`` is ``""``, its default) and refuses a prefix holding ``@``; its ``resp``
adapter has no prefix at all; both default to 8 workers.  A config moved from LMCache keeps
its objects where it put them and its worker count; the ``redis`` type keeps lmcache-tiers'
own defaults.  Checked through the real CLI's ``--print-config``, and on a real store."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cli_config import print_config
from lmcache_plugin_redis.testing import RedisServer, missing_reason

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.keycodec import key_to_name
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

WHERE = {"resp": {"host": "10.0.0.1", "port": 6379}, "valkey": {"startup_nodes": "10.0.0.1:6379"}}


def printed_adapter(adapter: dict[str, object]) -> dict[str, Any]:
    result = print_config(adapter)
    assert result.returncode == 0, result.stderr
    printed: dict[str, Any] = json.loads(result.stdout)["l2_adapters"][0]
    return printed


@pytest.mark.parametrize("type_name", ["resp", "valkey"])
def test_lmcache_type_names_keep_lmcaches_defaults(type_name: str) -> None:
    printed = printed_adapter({"type": type_name, **WHERE[type_name]})
    assert printed["key_prefix"] == ""
    assert printed["num_workers"] == 8


def test_the_redis_type_keeps_its_own_defaults() -> None:
    printed = printed_adapter({"type": "redis", "url": "redis://10.0.0.1:6379/0"})
    assert printed["key_prefix"] == "lmcache-tiers:"
    assert printed["num_workers"] == 2


@pytest.mark.parametrize("type_name", ["resp", "valkey"])
def test_given_values_are_kept(type_name: str) -> None:
    printed = printed_adapter(
        {"type": type_name, **WHERE[type_name], "key_prefix": "team-a", "num_workers": 3}
    )
    assert (printed["key_prefix"], printed["num_workers"]) == ("team-a", 3)


@pytest.mark.parametrize("type_name", ["resp", "valkey"])
def test_a_key_prefix_holding_the_separator_is_refused_naming_the_field(type_name: str) -> None:
    result = print_config({"type": type_name, **WHERE[type_name], "key_prefix": "team@a"})
    assert result.returncode != 0
    assert "key_prefix" in result.stderr and "'@'" in result.stderr
    assert len([line for line in result.stderr.splitlines() if "key_prefix" in line]) == 1


# -- where the objects live -------------------------------------------------------------------


@pytest.fixture
def open_adapter(opened: list[BackendAdapter]) -> Callable[..., BackendAdapter]:
    def make(type_name: str, **fields: Any) -> BackendAdapter:
        registry = load_registry()
        spec = decode_adapter(registry, {"type": type_name, **fields}, 0)
        facts = AdapterContext(index=0, name=f"0:{type_name}", config=spec.config)
        component = registry.get(Kind.L2_ADAPTER, type_name)
        adapter = create_adapter(component.load(), spec.config, facts, registry=registry, type_name=type_name)
        assert isinstance(adapter, BackendAdapter)
        opened.append(adapter)
        return adapter

    return make


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own: the test reads every name in it."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def stored_and_expected_names(adapter: BackendAdapter, server: RedisServer) -> tuple[set[str], set[str]]:
    """The names in the store after storing two keys, and those keys' names without a prefix."""
    keys = make_keys(2)
    data = [memoryview(bytearray(pattern(index, 4096))) for index in range(len(keys))]
    assert BlockingAdapterClient(adapter, timeout=30.0).store(keys, data) == [True] * len(keys)
    with redis.Redis.from_url(server.url) as raw:
        return {name.decode() for name in raw.scan_iter(count=1000)}, {key_to_name(key) for key in keys}


@pytest.mark.parametrize(
    ("type_name", "fields", "expected_prefix"),
    [
        ("valkey", {"key_prefix": "team-a"}, "team-a@"),
        ("valkey", {}, ""),
        ("resp", {}, ""),
        ("redis", {"key_prefix": "team-a"}, "team-a"),
    ],
    ids=["valkey-prefix", "valkey-default", "resp-default", "redis-prefix"],
)
def test_objects_are_named_as_lmcache_names_them(
    own_server: RedisServer,
    open_adapter: Callable[..., BackendAdapter],
    type_name: str,
    fields: dict[str, Any],
    expected_prefix: str,
) -> None:
    where = {
        "redis": {"url": own_server.url},
        "resp": {"host": "127.0.0.1", "port": own_server.port},
        "valkey": {"startup_nodes": own_server.address},
    }[type_name]
    adapter = open_adapter(type_name, **where, **fields)
    found, names = stored_and_expected_names(adapter, own_server)
    assert found == {expected_prefix + name for name in names}
