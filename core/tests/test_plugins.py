import sys
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


def test_a_name_two_plugins_register_is_used_by_neither() -> None:
    from lmcache_tiers.errors import ConfigError

    plugin_set = discover({"alpha": make_module("alpha"), "beta": make_module("beta", adapter="only_beta")})
    alpha, beta = (next(p for p in plugin_set.plugins if p.name == name) for name in ("alpha", "beta"))
    # both load; each is listed with the name it shares and the other distribution
    assert alpha.error is None and beta.error is None
    assert alpha.conflicts == ["serde:zdemo is also registered by 'beta'"]
    assert beta.conflicts == ["serde:zdemo is also registered by 'alpha'"]
    assert beta.status.startswith("conflict: serde:zdemo is also registered by 'alpha'; uninstall one")
    assert "serde:zdemo" in beta.components
    with pytest.raises(ConfigError, match=r"^serde 'zdemo' is registered by both 'alpha' and 'beta'; none"):
        plugin_set.registry.get(Kind.SERDE, "ZDEMO")
    # what only one of them registers is theirs, as before
    assert plugin_set.registry.get(Kind.L2_ADAPTER, "demo").plugin == "alpha"
    assert plugin_set.registry.get(Kind.L2_ADAPTER, "only_beta").plugin == "beta"


def test_a_contested_name_goes_back_to_the_one_left_when_the_other_is_rolled_back() -> None:
    registry = ComponentRegistry()
    registry.for_plugin(Kind.SERDE, "first").add("twin", "json:dumps")
    registry.for_plugin(Kind.SERDE, "second").add("twin", "json:loads")
    registry.remove_plugin("first")
    assert registry.get(Kind.SERDE, "twin").plugin == "second"
    assert registry.contested() == []


def test_a_plugin_registering_one_name_twice_is_its_own_error() -> None:
    registry = ComponentRegistry()
    registry.for_plugin(Kind.SERDE, "p").add("twin", "json:dumps")
    with pytest.raises(PluginError, match="serde:TWIN is registered twice by plugin 'p'"):
        registry.for_plugin(Kind.SERDE, "p").add("TWIN", "json:dumps")


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


def test_plugin_whose_hook_calls_sys_exit_is_isolated() -> None:
    exiting = types.ModuleType("exiting")

    @hookimpl
    def tiers_register_serdes(registry):  # type: ignore[no-untyped-def]
        registry.add("half", "json:dumps")
        sys.exit("no GPU here")

    exiting.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"exiting": exiting, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["exiting"] == "error: SystemExit: no GPU here"
    assert statuses["demo"] == "ok"
    assert "half" not in plugin_set.registry.names(Kind.SERDE)


def test_a_registration_hook_implemented_under_another_name_registers() -> None:
    # pluggy's specname: the function's own name need not be the hook's
    named = types.ModuleType("named")

    @hookimpl(specname="tiers_register_serdes")
    def add_serdes(registry):  # type: ignore[no-untyped-def]
        registry.add("renamed", "json:dumps")

    named.add_serdes = add_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"named": named})
    info = next(p for p in plugin_set.plugins if p.name == "named")
    assert (info.status, info.components) == ("ok", ["serde:renamed"])


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


def test_a_registration_whose_doc_is_not_text_is_that_plugins_error() -> None:
    # `plugins show` prints the doc: a list there would crash the command long after
    # registration said "ok".
    broken = types.ModuleType("broken_doc")

    @hookimpl
    def tiers_register_serdes(registry):  # type: ignore[no-untyped-def]
        registry.add("listed_doc", "json:dumps", doc=["not", "text"])

    broken.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"broken_doc": broken, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["broken_doc"].startswith("error:") and "serde:listed_doc" in statuses["broken_doc"]
    assert "listed_doc" not in plugin_set.registry.names(Kind.SERDE)
    assert statuses["demo"] == "ok"


def test_every_hookspec_is_documented() -> None:
    specs = [name for name in dir(hookspecs) if name.startswith("tiers_")]
    assert len(specs) >= 9
    for name in specs:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert len(doc.split()) > 10, f"{name} needs a docstring saying when it runs"


def test_registry_rejects_a_factory_that_is_neither_callable_nor_a_string() -> None:
    adder = ComponentRegistry().for_plugin(Kind.SERDE, "p")
    with pytest.raises(PluginError, match=r"plugin 'p'.*serde:x.*'module:attr'"):
        adder.add("x", None)  # type: ignore[arg-type]


def test_factory_module_failing_on_import_is_a_load_error_naming_the_plugin(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tiers_boom_on_import.py").write_text("raise RuntimeError('no GPU here')\n")  # type: ignore[operator]
    monkeypatch.syspath_prepend(str(tmp_path))
    adder = ComponentRegistry().for_plugin(Kind.SERDE, "p")
    adder.add("boom", "tiers_boom_on_import:make")
    adder.add("nomodule", ":make")
    registry = adder._owner
    with pytest.raises(ComponentLoadError, match=r"serde:boom from plugin 'p'.*RuntimeError: no GPU here"):
        registry.get(Kind.SERDE, "boom").load()
    with pytest.raises(ComponentLoadError, match=r"serde:nomodule from plugin 'p'"):
        registry.get(Kind.SERDE, "nomodule").load()


def test_factory_module_calling_sys_exit_on_import_is_a_load_error_naming_the_plugin(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tiers_exit_on_import.py").write_text("import sys\nsys.exit('no GPU here')\n")  # type: ignore[operator]
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = ComponentRegistry()
    registry.for_plugin(Kind.SERDE, "p").add("quits", "tiers_exit_on_import:make")
    with pytest.raises(ComponentLoadError, match=r"serde:quits from plugin 'p'.*SystemExit: no GPU here"):
        registry.get(Kind.SERDE, "quits").load()


def test_failing_entry_point_keeps_its_sibling_of_the_same_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lmcache_tiers import plugins
    from lmcache_tiers.plugins import PluginInfo

    broken = types.ModuleType("broken")

    @hookimpl
    def tiers_register_serdes(registry):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    broken.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    modules = {"a_good": make_module("a_good"), "b_broken": broken}
    monkeypatch.setattr(
        plugins,
        "_entry_point_infos",
        lambda: [(None, PluginInfo(name, "lmcache-plugin-pair", "1.0", name)) for name in modules],
    )
    monkeypatch.setattr(plugins, "_load_modules", lambda infos: dict(modules))
    plugin_set = discover()
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses == {"a_good": "ok", "b_broken": "error: RuntimeError: boom"}
    # what the healthy entry point registered is still there
    assert plugin_set.registry.get(Kind.L2_ADAPTER, "demo").plugin == "lmcache-plugin-pair"


def test_policy_whose_config_fails_to_build_is_a_config_error_naming_it() -> None:
    import msgspec

    from lmcache_tiers.errors import ConfigError
    from lmcache_tiers.storage_wiring import build_policy

    class BrokenConfig(msgspec.Struct):
        def __post_init__(self) -> None:
            raise ValueError("bad default")

    registry = ComponentRegistry()
    registry.for_plugin(Kind.EVICTION_POLICY, "lmcache-plugin-odd").add("odd", "json:dumps", BrokenConfig)
    with pytest.raises(ConfigError, match=r"eviction_policy:odd.*lmcache-plugin-odd.*bad default"):
        build_policy(registry, Kind.EVICTION_POLICY, "odd")


def test_entry_point_module_failing_an_assert_is_reported_not_raised(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stevedore hands an Exception to the failure callback but re-raises AssertionError.
    module = "tiers_asserting_plugin"
    dist = tmp_path / f"{module}-1.0.dist-info"  # type: ignore[operator]
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\nasserting = {module}\n")
    (tmp_path / f"{module}.py").write_text("assert False, 'needs a GPU'\n")  # type: ignore[operator]
    monkeypatch.syspath_prepend(str(tmp_path))
    from stevedore import ExtensionManager

    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})  # scanned once per process
    plugin_set = discover()
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["asserting"] == "error: AssertionError: needs a GPU"
    assert statuses["frontend-native"] == "ok"


def test_an_entry_point_of_a_distribution_without_a_name_is_listed_not_fatal(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A METADATA without Name (a broken or half-written install) reads as a None name.
    module = "tiers_nameless_plugin"
    dist = tmp_path / f"{module}-1.0.dist-info"  # type: ignore[operator]
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\nnameless = {module}\n")
    (tmp_path / f"{module}.py").write_text("")  # type: ignore[operator]
    monkeypatch.syspath_prepend(str(tmp_path))
    from stevedore import ExtensionManager

    monkeypatch.setattr(ExtensionManager, "ENTRY_POINT_CACHE", {})  # scanned once per process
    plugin_set = discover()
    nameless = next(p for p in plugin_set.plugins if p.name == "nameless")
    assert (nameless.distribution, nameless.version, nameless.status) == ("?", "?", "ok")
    assert next(p for p in plugin_set.plugins if p.name == "frontend-native").status == "ok"


def test_two_distributions_naming_the_same_entry_point_are_both_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lmcache_tiers import plugins
    from lmcache_tiers.plugins import PluginInfo

    monkeypatch.setattr(
        plugins,
        "_entry_point_infos",
        lambda: [
            (None, PluginInfo("twin", "lmcache-plugin-one", "1.0", "one")),
            (None, PluginInfo("twin", "lmcache-plugin-two", "1.0", "two")),
        ],
    )
    monkeypatch.setattr(plugins, "_load_modules", lambda infos: {"twin": make_module("twin")})
    plugin_set = discover()
    twins = [p for p in plugin_set.plugins if p.name == "twin"]
    assert len(twins) == 2
    for twin in twins:
        assert twin.error is not None
        assert "lmcache-plugin-one" in twin.error and "lmcache-plugin-two" in twin.error
    assert plugin_set.registry.names(Kind.L2_ADAPTER) == []


def test_a_plugin_whose_command_hook_raises_loses_its_commands_not_the_cli(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import typer

    from lmcache_tiers.cli.main import add_plugin_commands

    broken = types.ModuleType("broken")
    good = types.ModuleType("good")

    @hookimpl
    def tiers_register_commands(app):  # type: ignore[no-untyped-def]
        raise RuntimeError("no such attribute")

    @hookimpl(specname="tiers_register_commands")
    def add_hello(app):  # type: ignore[no-untyped-def]
        app.command("hello")(lambda: None)

    broken.tiers_register_commands = tiers_register_commands  # type: ignore[attr-defined]
    good.tiers_register_commands = add_hello  # type: ignore[attr-defined]
    plugin_set = discover({"broken": broken, "good": good})
    app = typer.Typer()
    add_plugin_commands(app, plugin_set)
    assert [command.name for command in app.registered_commands] == ["hello"]
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["broken"] == "error: its commands failed to register: RuntimeError: no such attribute"
    assert statuses["good"] == "ok"
    err = capsys.readouterr().err
    assert "plugin broken: its commands failed to register" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("failure", "line"),
    [(RuntimeError("boom"), "RuntimeError: boom"), (SystemExit(3), "PluginError: SystemExit: 3")],
    ids=["raises", "sys-exit"],
)
def test_a_server_hook_failing_in_one_plugin_still_runs_the_others(
    caplog: pytest.LogCaptureFixture, failure: BaseException, line: str
) -> None:
    # pluggy's own call stops at the first implementation that raises: a stopping hook
    # that flushes would never run because another plugin's failed.
    from lmcache_tiers.plugins import new_manager
    from lmcache_tiers.server.app import _call_hook

    called: list[str] = []
    first, second = types.ModuleType("first"), types.ModuleType("second")

    @hookimpl(specname="tiers_server_stopping")
    def flush(config, storage):  # type: ignore[no-untyped-def]
        called.append("flushed")

    @hookimpl(specname="tiers_server_stopping")
    def broken(config, storage):  # type: ignore[no-untyped-def]
        raise failure

    first.tiers_server_stopping = flush  # type: ignore[attr-defined]
    second.tiers_server_stopping = broken  # type: ignore[attr-defined]
    manager = new_manager()
    manager.register(first, name="first")
    manager.register(second, name="second")  # pluggy calls the last registered first
    _call_hook(manager.hook, "tiers_server_stopping", config=None, storage=None)
    assert called == ["flushed"]
    assert f"plugin second: hook tiers_server_stopping failed: {line}" in caplog.text
    # the log names where in the plugin it failed (a sys.exit() too: its traceback)
    assert ", in broken\n" in caplog.text


def test_a_command_hook_failing_half_way_or_calling_sys_exit_leaves_no_command_behind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The warning says the plugin's commands are left out: those it added before it
    # raised too, and a sys.exit() in it must not end every command (as in registration).
    import typer

    from lmcache_tiers.cli.main import add_plugin_commands

    half, exiting, good = (types.ModuleType(name) for name in ("half", "exiting", "good"))

    @hookimpl(specname="tiers_register_commands")
    def add_one_then_raise(app):  # type: ignore[no-untyped-def]
        app.command("half-first")(lambda: None)
        app.add_typer(typer.Typer(), name="half-group")
        raise RuntimeError("second command failed")

    @hookimpl(specname="tiers_register_commands")
    def add_one_then_exit(app):  # type: ignore[no-untyped-def]
        app.command("exit-first")(lambda: None)
        sys.exit("no GPU here")

    @hookimpl(specname="tiers_register_commands")
    def add_hello(app):  # type: ignore[no-untyped-def]
        app.command("hello")(lambda: None)

    half.tiers_register_commands = add_one_then_raise  # type: ignore[attr-defined]
    exiting.tiers_register_commands = add_one_then_exit  # type: ignore[attr-defined]
    good.tiers_register_commands = add_hello  # type: ignore[attr-defined]
    plugin_set = discover({"half": half, "exiting": exiting, "good": good})
    app = typer.Typer()
    add_plugin_commands(app, plugin_set)
    assert [command.name for command in app.registered_commands] == ["hello"]
    assert app.registered_groups == []
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["exiting"] == "error: its commands failed to register: SystemExit: no GPU here"
    assert statuses["half"] == "error: its commands failed to register: RuntimeError: second command failed"
    assert statuses["good"] == "ok"
    assert len(capsys.readouterr().err.strip().splitlines()) == 2
