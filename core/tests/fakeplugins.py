"""In-process plugin modules for framework tests (installed plugins are tested via CLI)."""

from __future__ import annotations

import types
from typing import Annotated

import msgspec

from lmcache_tiers.config import ComponentConfig, L2AdapterConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class DemoAdapterConfig(L2AdapterConfig):
    """A demo adapter."""

    size_gb: Annotated[float, msgspec.Meta(gt=0, description="Capacity.")] = 1.0
    path: str = "/tmp/x"


class DemoSerdeConfig(ComponentConfig):
    """A demo serde."""

    level: Annotated[int, msgspec.Meta(ge=1, le=9)] = 3


def make_module(name: str = "demo", adapter: str = "demo") -> types.ModuleType:
    """A plugin registering l2_adapter ``adapter`` and serde ``zdemo``: names no shipped
    plugin registers (the policies come from the shipped ones: a name two distributions
    register is contested, and a configuration using it refused)."""
    module = types.ModuleType(name)

    @hookimpl
    def tiers_register_l2_adapters(registry: KindRegistry) -> None:
        registry.add(adapter, "json:dumps", DemoAdapterConfig)

    @hookimpl
    def tiers_register_serdes(registry: KindRegistry) -> None:
        registry.add("zdemo", "json:dumps", DemoSerdeConfig)

    for hook in (
        tiers_register_l2_adapters,
        tiers_register_serdes,
    ):
        setattr(module, hook.__name__, hook)
    return module
