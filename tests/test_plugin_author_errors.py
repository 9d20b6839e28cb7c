"""Mistakes a third-party plugin author makes, each reported as one line naming the plugin."""

from __future__ import annotations

import types
from typing import Any

import msgspec
import pytest

from lmcache_tiers.errors import PluginError
from lmcache_tiers.plugin import EmptyConfig, L2AdapterConfig, hookimpl
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry, Kind


def _plugin(name: str, **hooks: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


class _Backend:
    def __init__(self, config: Any, context: Any) -> None:
        raise RuntimeError("cannot reach the store")


def test_a_registration_hook_returning_components_instead_of_adding_them_is_an_error() -> None:
    """Returning the components (a list, a dict) registers nothing: the plugin would be
    listed "ok" with no component and its type unknown to serve, with nothing saying why."""

    def tiers_register_l2_adapters(registry: Any) -> Any:
        return [("returned", "returned_pkg.backend:Backend", L2AdapterConfig)]

    plugin_set = discover(
        {"returner": _plugin("returner", tiers_register_l2_adapters=tiers_register_l2_adapters)}
    )
    info = next(p for p in plugin_set.plugins if p.name == "returner")
    assert info.error is not None
    assert "tiers_register_l2_adapters returned a list" in info.error
    assert "registry.add" in info.error
    assert "\n" not in info.error


class _NotDecodable:
    """A type no JSON or TOML value decodes into."""


class _UndecodableConfig(L2AdapterConfig):
    """A config with a field users can never set."""

    handle: _NotDecodable | None = None


def test_a_config_struct_with_a_field_type_config_cannot_hold_is_refused_at_registration() -> None:
    """Before: listed "ok", and every value a user gave the field was refused at serve
    ("Expected `_NotDecodable`, got `int`") with no word of the plugin's mistake."""
    registry = ComponentRegistry()
    with pytest.raises(PluginError) as caught:
        registry.for_plugin(Kind.L2_ADAPTER, "lmcache-plugin-odd").add(
            "odd", "odd_pkg.backend:Backend", _UndecodableConfig
        )
    message = str(caught.value)
    assert "plugin 'lmcache-plugin-odd'" in message and "l2_adapter:odd" in message
    assert "field 'handle'" in message and "_NotDecodable" in message
    assert "\n" not in message


def test_a_config_struct_of_supported_types_still_registers() -> None:
    class Fine(L2AdapterConfig):
        path: str = "/tmp"
        sizes: list[int] = msgspec.field(default_factory=list)

    registry = ComponentRegistry()
    registry.for_plugin(Kind.L2_ADAPTER, "p").add("fine", "fine_pkg:Backend", Fine)
    registry.for_plugin(Kind.STORE_POLICY, "p").add("plain", "fine_pkg:Policy", EmptyConfig)
    assert registry.get(Kind.L2_ADAPTER, "fine").config is Fine


def test_a_factory_raising_names_its_component_and_plugin() -> None:
    """A policy, serde or front end whose constructor raises: the error says whose."""

    def failing_policy(config: Any) -> Any:
        raise KeyError("threshold")

    registry = ComponentRegistry()
    registry.for_plugin(Kind.STORE_POLICY, "lmcache-plugin-picky").add("picky", failing_policy)
    with pytest.raises(PluginError) as caught:
        registry.get(Kind.STORE_POLICY, "picky").create(EmptyConfig())
    message = str(caught.value)
    assert "store_policy:picky" in message and "plugin 'lmcache-plugin-picky'" in message
    assert "KeyError" in message and "threshold" in message
    assert isinstance(caught.value.__cause__, KeyError)


def test_an_l2_backend_raising_in_init_names_its_plugin() -> None:
    from lmcache_tiers.config import AdapterSpec
    from lmcache_tiers.l2 import build_adapter
    from lmcache_tiers.l2.context import AdapterContext

    registry = ComponentRegistry()
    registry.for_plugin(Kind.L2_ADAPTER, "lmcache-plugin-flaky").add("flaky", _Backend, L2AdapterConfig)
    spec = AdapterSpec(type="flaky", config=L2AdapterConfig())
    facts = AdapterContext(index=0, name="0:flaky", config=spec.config)
    with pytest.raises(PluginError) as caught:
        build_adapter(registry, spec, facts)
    message = str(caught.value)
    assert "'flaky'" in message and "plugin 'lmcache-plugin-flaky'" in message
    assert "RuntimeError: cannot reach the store" in message
