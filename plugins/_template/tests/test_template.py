"""``template`` against the L2 adapter conformance suite (through its entry point)."""

from __future__ import annotations

from lmcache_plugin_template import TemplateConfig

from lmcache_tiers.plugin import CAPACITY, EVICTION, L2AdapterSuite


class TestTemplate(L2AdapterSuite):
    component_name = "template"
    # No PERSISTENCE: objects live as long as one adapter.  Add it (and a reopen_adapter
    # fixture if the same config does not reach the same storage) for a persistent backend.
    # One whose config names a file or directory mixes in ScratchDirectory (from
    # lmcache_tiers.plugin, listed before L2AdapterSuite) and builds its config on
    # self.storage_dir: a fresh directory per test, removed after it.
    capabilities = frozenset({CAPACITY, EVICTION})
    # A backend whose store a test can make fail (a server it starts, killed and started
    # again on the same port and data, or frozen with SIGSTOP; a directory made
    # unreadable) declares BACKEND_FAILURES and overrides failing_storage(self, adapter),
    # a context manager inside which the real store fails and after which it is back with
    # its objects: the suite then checks a failing store is never answered "absent".
    # One whose test can change a byte where an object is kept (its file, its row)
    # declares DETECTS_DAMAGE and overrides damage_stored(self, adapter, key): the suite
    # then checks a damaged object is never loaded and is not found again.

    def make_config(self) -> TemplateConfig:
        return TemplateConfig(max_size_gb=1 / 4096)  # 256 KiB, filled by the capacity tests
