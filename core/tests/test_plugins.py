import types

import pytest
from fakeplugins import make_module

from lmcache_tiers import hookspecs
from lmcache_tiers.errors import ComponentLoadError, PluginError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry, Kind


def test_components_are_registered_with_their_plugin() -> None:
    plugin_set = discover({"demo": make_module()})
    info = next(p for p in plugin_set.plugins if p.name == "demo")
    assert info.status == "ok"
    assert "l2_adapter:demo" in info.components and "serde:zdemo" in info.components
    component = plugin_set.registry.get(Kind.L2_ADAPTER, "demo")
    assert component.plugin == "demo" and component.doc == "A demo adapter."


def test_factory_strings_are_imported_on_first_use_only() -> None:
    registry = ComponentRegistry()
    registry.for_plugin(Kind.SERDE, "p").add("lazy", "json:dumps")
    registry.for_plugin(Kind.SERDE, "p").add(
        "missing", "no_such_module_xyz:thing", install_hint="pip install xyz"
    )
    registry.for_plugin(Kind.SERDE, "p").add("badattr", "json:no_such_attr")
    assert registry.get(Kind.SERDE, "lazy").create([1]) == "[1]"
    with pytest.raises(
        ComponentLoadError, match=r"serde:missing from plugin 'p' cannot be loaded.*pip install xyz"
    ):
        registry.get(Kind.SERDE, "missing").load()
    with pytest.raises(ComponentLoadError, match="does not exist"):
        registry.get(Kind.SERDE, "badattr").load()


def test_conflicting_registrations_name_both_plugins() -> None:
    plugin_set = discover({"alpha": make_module("alpha"), "beta": make_module("beta")})
    beta = next(p for p in plugin_set.plugins if p.name == "beta")
    assert beta.error is not None
    assert "'alpha'" in beta.error and "'beta'" in beta.error
    # the losing plugin registered nothing; the winner is intact
    assert plugin_set.registry.get(Kind.L2_ADAPTER, "demo").plugin == "alpha"
    assert beta.components == []


def test_plugin_whose_hook_raises_is_isolated() -> None:
    broken = types.ModuleType("broken")

    @hookimpl
    def tiers_register_serdes(registry):  # type: ignore[no-untyped-def]
        registry.add("half", "json:dumps")
        raise RuntimeError("boom")

    broken.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"broken": broken, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["broken"] == "error: RuntimeError: boom"
    assert statuses["demo"] == "ok"
    assert "half" not in plugin_set.registry.names(Kind.SERDE)


def test_hook_with_wrong_signature_or_unknown_name_is_reported() -> None:
    wrong = types.ModuleType("wrong")

    @hookimpl
    def tiers_register_serdes(registry, extra):  # type: ignore[no-untyped-def]
        pass

    wrong.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    typo = types.ModuleType("typo")

    @hookimpl
    def tiers_register_serdess(registry):  # type: ignore[no-untyped-def]
        pass

    typo.tiers_register_serdess = tiers_register_serdess  # type: ignore[attr-defined]
    plugin_set = discover({"wrong": wrong, "typo": typo, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["wrong"].startswith("error: invalid hooks")
    assert statuses["typo"].startswith("error: invalid hooks")
    assert statuses["demo"] == "ok"


def test_registry_rejects_bad_registrations() -> None:
    registry = ComponentRegistry()
    adder = registry.for_plugin(Kind.SERDE, "p")
    with pytest.raises(PluginError, match=r"must be a msgspec\.Struct"):
        adder.add("x", "json:dumps", dict)  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="'module:attr'"):
        adder.add("x", "json.dumps")
    with pytest.raises(PluginError, match="no name"):
        adder.add("", "json:dumps")


def test_every_hookspec_is_documented() -> None:
    specs = [name for name in dir(hookspecs) if name.startswith("tiers_")]
    assert len(specs) >= 9
    for name in specs:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert len(doc.split()) > 10, f"{name} needs a docstring saying when it runs"
