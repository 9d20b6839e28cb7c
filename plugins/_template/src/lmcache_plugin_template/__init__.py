"""Manifest of the plugin: its config Struct and the hook that registers it.

Keep this module light. It is imported by every ``lmcache-tiers plugins list`` and
``serve``; the implementation (and any heavy backend library) lives in ``adapter.py`` and
is imported only when an adapter of this type is configured.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.registry import KindRegistry


class TemplateMemoryConfig(L2AdapterConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Objects kept in a dict of this process (a starting point for real backends)."""

    max_size_gb: Annotated[
        float, msgspec.Meta(gt=0.0, description="Capacity in GiB; a store that does not fit fails.")
    ] = 1.0


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add(
        "template_memory",
        "lmcache_plugin_template.adapter:TemplateMemoryAdapter",
        TemplateMemoryConfig,
        install_hint="pip install lmcache-plugin-template",
    )
