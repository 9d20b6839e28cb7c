"""``template`` against the L2 adapter conformance suite (through its entry point)."""

from __future__ import annotations

from lmcache_plugin_template import TemplateConfig

from lmcache_tiers.plugin import CAPACITY, EVICTION, L2AdapterSuite


class TestTemplate(L2AdapterSuite):
    component_name = "template"
    # No PERSISTENCE: objects live as long as one adapter.  Add it (and a reopen_adapter
    # fixture if the same config does not reach the same storage) for a persistent backend.
    capabilities = frozenset({CAPACITY, EVICTION})

    def make_config(self) -> TemplateConfig:
        return TemplateConfig(max_size_gb=1 / 4096)  # 256 KiB, filled by the capacity tests
