"""Manifest of ``lmcache-plugin-template``: the config Struct and the hook that registers ``template``.

Keep this module light.  It is imported by every ``lmcache-tiers plugins list`` and
``serve``; the implementation (and any backend library) lives in ``backend.py`` and is
imported only when an adapter of this type is configured.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmcache_tiers.plugin import KindRegistry, L2AdapterConfig, SizeGiB, check_size_gib, hookimpl


class TemplateConfig(L2AdapterConfig):
    """Objects kept in a dict of this process (a starting point for a real backend)."""

    max_size_gb: Annotated[
        SizeGiB, msgspec.Meta(gt=0.0, description="Capacity in GiB; stores that do not fit are refused.")
    ] = 1.0

    def __post_init__(self) -> None:
        check_size_gib("max_size_gb", self.max_size_gb)  # under one byte would refuse every store


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add(
        "template",
        "lmcache_plugin_template.backend:TemplateBackend",
        TemplateConfig,
        install_hint="pip install lmcache-plugin-template",
    )
