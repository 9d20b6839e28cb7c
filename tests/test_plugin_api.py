"""``lmcache_tiers.plugin`` is the one import surface of plugins: every shipped plugin uses
it and nothing else from core (that importing it stays cheap is checked with the listing
of plugins, in test_shipped_plugins)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmcache_tiers.plugin as plugin

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(ROOT.glob("plugins/*/src/**/*.py"))


def core_imports(source: Path) -> list[str]:
    """Every ``lmcache_tiers`` module a file imports (at any depth, lazily or not)."""
    found = []
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lmcache_tiers":
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "lmcache_tiers"]
    return found


def test_shipped_plugins_import_only_the_plugin_api() -> None:
    assert len({path.parts[len(ROOT.parts) + 1] for path in SOURCES}) >= 10, "plugin sources not found"
    offenders = {
        str(path.relative_to(ROOT)): modules
        for path in SOURCES
        if (modules := [m for m in core_imports(path) if m != "lmcache_tiers.plugin"])
    }
    assert offenders == {}


def test_every_exported_name_resolves() -> None:
    for name in plugin.__all__:
        assert getattr(plugin, name) is not None, name
    with pytest.raises(AttributeError):
        _ = plugin.NoSuchName  # type: ignore[attr-defined]


def test_config_structs_inherit_their_flags() -> None:
    class Inherits(plugin.L2AdapterConfig):
        required: int
        optional: int = 1

    config = Inherits(required=2)
    assert Inherits.__struct_config__.frozen and Inherits.__struct_config__.forbid_unknown_fields
    with pytest.raises(TypeError):
        Inherits(2)  # type: ignore[misc]  # keyword-only
    with pytest.raises(AttributeError):
        config.required = 3  # type: ignore[misc]  # frozen


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "bad..name", "nul\x00host"])
def test_is_loopback_says_no_for_a_host_no_resolver_takes(host: str) -> None:
    # Front ends check their configured host with it: a name the resolver cannot even
    # encode must read as "not loopback" (a token is then required; binding it fails with
    # a clear error), never escape as a UnicodeError or TypeError with a traceback.
    assert plugin.is_loopback(host) is False
