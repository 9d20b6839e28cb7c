"""The template adapter passes the L2 conformance suite (copy this for your plugin)."""

from __future__ import annotations

from lmcache_plugin_template import TemplateMemoryConfig

from lmcache_tiers.testing.l2 import CAPACITY, EVICTION, L2AdapterSuite


class TestTemplateMemory(L2AdapterSuite):
    component_name = "template_memory"
    # no PERSISTENCE: objects live in one adapter instance only
    capabilities = frozenset({CAPACITY, EVICTION})

    def make_config(self) -> TemplateMemoryConfig:
        return TemplateMemoryConfig(max_size_gb=1 / 4096)  # 256 KiB, filled by the capacity tests
