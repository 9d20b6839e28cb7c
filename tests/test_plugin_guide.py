"""The complete adapter of docs/plugin-guide.md runs the L2 conformance suite as written."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

import lmcache_tiers.testing.base as testing_base
from lmcache_tiers.plugin import CAPACITY, EVICTION, L2AdapterSuite
from lmcache_tiers.plugins import PluginSet, discover

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugin-guide.md"
MARKER = "<!-- plugin-guide-example -->"


def example_source() -> str:
    text = GUIDE.read_text()
    match = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.S)
    assert match is not None, f"{GUIDE} lost its example (after {MARKER})"
    return match.group(1)


def example_module() -> types.ModuleType:
    module = types.ModuleType("plugin_guide_example")
    # dont_inherit: the example runs as written, not under this file's `from __future__
    # import annotations` (its annotations would be strings naming nothing in sys.modules)
    exec(compile(example_source(), str(GUIDE), "exec", dont_inherit=True), module.__dict__)
    return module


_plugins: PluginSet | None = None


def plugins_with_the_example() -> PluginSet:
    global _plugins
    if _plugins is None:
        _plugins = discover(extra_plugins={"plugin-guide-example": example_module()})
    return _plugins


def test_the_example_is_short_and_imports_only_the_plugin_api() -> None:
    source = example_source()
    assert len(source.splitlines()) <= 60
    core = [line for line in source.splitlines() if "lmcache_tiers" in line]
    assert core == [line for line in core if line.startswith("from lmcache_tiers.plugin import ")]


class TestPluginGuideExample(L2AdapterSuite):
    component_name = "memory"
    capabilities = frozenset({CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _with_the_example(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(testing_base, "load_plugins", plugins_with_the_example)

    def make_config(self) -> object:
        config_type = self.registered_component().config
        return config_type(max_size_gb=1 / 4096)  # type: ignore[call-arg]
