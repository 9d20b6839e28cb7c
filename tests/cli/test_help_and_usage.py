"""Help and usage conventions: -h everywhere, defaults shown, no value placeholder on
switches, lists of installed components from the registry, usage errors exit 2 in one line."""

from __future__ import annotations

import re
import threading
import types
from typing import Any

import msgspec
import pytest
from thirdparty import run_cli, run_cli_in_process

from lmcache_tiers.cli import plugins_cmd
from lmcache_tiers.cli.main import build_app, command_tree, main
from lmcache_tiers.config import L2AdapterConfig, ServerConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.plugins import discover, load_plugins
from lmcache_tiers.registry import Kind


def _commands() -> list[list[str]]:
    """The argument prefix of every command and group, the root included."""
    found: list[list[str]] = []
    pending: list[tuple[list[str], Any]] = [([], command_tree(build_app()))]
    while pending:
        path, command = pending.pop()
        found.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            pending.append(([*path, name], sub))
    return sorted(found)


def _help(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    main([*args])
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")


def test_every_command_and_group_takes_dash_h(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands()
    assert ["serve"] in commands and ["plugins", "show"] in commands and ["bench"] in commands
    for path in commands:
        short = _help(capsys, *path, "-h")
        assert short == _help(capsys, *path, "--help"), path
        assert f"Usage: lmcache-tiers {' '.join(path)}".rstrip() in short, path
        assert re.search(r"--help\s+-h\s", short), path


def test_switches_show_no_value_placeholder(capsys: pytest.CaptureFixture[str]) -> None:
    for path in _commands():
        text = _help(capsys, *path, "-h")
        assert "<bool>" not in text, path
    root = _help(capsys, "-h")
    assert re.search(r"--version\s+Print the version", root)


def test_no_help_text_loses_a_bracketed_default_to_markup(capsys: pytest.CaptureFixture[str]) -> None:
    # rich reads "[default: ...]" in a help string as a markup tag and drops it, leaving
    # "text ." behind; written escaped, it shows.
    for path in _commands():
        text = _help(capsys, *path, "-h")
        assert not re.search(r"\w \.(\s|$)", text), (path, text)
    replay = " ".join(_help(capsys, "replay", "-h").split())
    assert "Eviction policies to simulate; repeat for several. [default: every installed one]" in replay
    assert "[default: the likeliest]" in replay


def test_serve_help_shows_defaults_and_installed_components(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(capsys, "serve", "-h").split())
    defaults = ServerConfig()
    for flag, value in [
        ("--l1-size-gb", defaults.l1_size_gb),
        ("--l1-read-ttl-seconds", defaults.l1_lock_ttl_s),
        ("--eviction-trigger-watermark", defaults.eviction_trigger_watermark),
        ("--eviction-ratio", defaults.eviction_ratio),
        ("--l2-prefetch-max-in-flight", defaults.l2_prefetch_max_in_flight),
        ("--port", defaults.port),
        ("--chunk-size", defaults.chunk_size),
        ("--metrics-port,--http-port", defaults.metrics_port),
    ]:
        assert re.search(rf"{re.escape(flag)} .*?\[default: {re.escape(str(value))}\]", text), flag
    registry = load_plugins().registry
    for kind in (Kind.L2_ADAPTER, Kind.EVICTION_POLICY, Kind.STORE_POLICY, Kind.PREFETCH_POLICY):
        assert f"installed: {', '.join(registry.names(kind))}" in text, kind
    root = " ".join(_help(capsys, "-h").split())
    assert f"installed here: {', '.join(registry.names(Kind.L2_ADAPTER))}" in root


def test_replay_help_shows_the_default_of_every_option_that_has_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(_help(capsys, "replay", "-h").split())
    defaults = ServerConfig()
    for flag, value in [
        ("--model", "lmcache-tiers-replay"),
        ("--salt", "replay"),
        ("--capacity", "powers of two from 256 blocks up to the trace's working set"),
        ("--l1-size-gb", defaults.l1_size_gb),
        ("--eviction-policy", defaults.eviction_policy),
        ("--eviction-trigger-watermark", f"{defaults.eviction_trigger_watermark} in-process"),
        ("--eviction-ratio", defaults.eviction_ratio),
        ("--l2-store-policy", defaults.l2_store_policy),
        ("--l2-prefetch-policy", defaults.l2_prefetch_policy),
        ("--l2-prefetch-max-in-flight", defaults.l2_prefetch_max_in_flight),
    ]:
        assert re.search(rf"{re.escape(flag)} .*?\[default: {re.escape(str(value))}", text), flag


def test_plugins_show_of_an_unknown_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["plugins", "show", "no-such-plugin"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no plugin or component named 'no-such-plugin'; installed plugins: ")
    assert len(err.splitlines()) == 1


def test_plugins_show_of_a_misspelled_name_suggests_the_installed_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["plugins", "show", "fss"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no plugin or component named 'fss'; did you mean 'fs'? installed plugins: ")


def test_plugins_show_says_no_options_and_dedents_docs(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "plugins", "show", "store-skip-l1")
    assert text.startswith("store_policy:skip_l1  (plugin lmcache-plugin-store-skip-l1)\nno options\n")
    assert "\nWith eviction policy ``noop``" in text  # a docstring's second paragraph, not indented
    mock = _help(capsys, "plugins", "show", "mock")
    assert "\nStores fail once ``max_size_gb`` is full" in mock and "\n    " not in mock


def test_plugins_show_prints_types_with_their_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    # `[object]` is text, not a style tag for the table to swallow
    assert "│ list[object] " in _help(capsys, "plugins", "show", "mock")


def test_a_config_no_value_can_fill_fails_its_plugin_and_the_others_are_still_described(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # msgspec decodes no configuration value into a field of an arbitrary class: the
    # plugin is refused when it registers, naming the field, and the commands describing
    # plugins still work for the others.
    class OddConfig(msgspec.Struct):
        """An odd policy."""

        event: threading.Event | None = None

    @hookimpl
    def tiers_register_store_policies(registry):  # type: ignore[no-untyped-def]
        registry.add("odd", "json:dumps", OddConfig)

    odd = types.ModuleType("odd")
    odd.tiers_register_store_policies = tiers_register_store_policies  # type: ignore[attr-defined]
    plugin_set = discover({"lmcache-plugin-odd": odd})
    monkeypatch.setattr(plugins_cmd, "load_plugins", lambda: plugin_set)
    with pytest.raises(SystemExit) as exited:
        main(["plugins", "show", "lmcache-plugin-odd"])
    assert exited.value.code == 1
    refusal = capsys.readouterr().err
    assert "lmcache-plugin-odd" in refusal
    assert "field 'event' of a type no configuration value decodes into" in refusal
    main(["plugins", "reference"])
    reference = capsys.readouterr()
    assert "### `odd`" not in reference.out
    assert "### `skip_l1` (lmcache-plugin-store-skip-l1)" in reference.out
    assert reference.err.startswith("warning: plugin lmcache-plugin-odd failed to load: ")
    assert reference.err.rstrip().endswith("its components are not documented")


class CircuitConfig(L2AdapterConfig):
    """An adapter whose config is named like the core Struct of its `circuit` field (what
    `plugins new circuit --kind l2` writes)."""

    size_gb: float = 1.0


def test_plugins_show_lists_the_fields_of_a_config_named_like_a_core_struct(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @hookimpl
    def tiers_register_l2_adapters(registry):  # type: ignore[no-untyped-def]
        registry.add("circuit", "json:dumps", CircuitConfig)

    plugin = types.ModuleType("circuit")
    plugin.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    plugin_set = discover({"lmcache-plugin-circuit": plugin})
    monkeypatch.setattr(plugins_cmd, "load_plugins", lambda: plugin_set)
    shown = _help(capsys, "plugins", "show", "lmcache-plugin-circuit")
    assert "no options" not in shown
    assert "size_gb" in shown and "failure_threshold" not in shown


def test_plugins_list_shows_an_error_with_brackets_as_written(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rich reads `[int]` as a style tag and `[/]` as a closing one (which has nothing to close).
    @hookimpl
    def tiers_register_serdes(registry):  # type: ignore[no-untyped-def]
        raise TypeError("list[int] [/]")

    broken = types.ModuleType("broken")
    broken.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"broken": broken})
    monkeypatch.setattr(plugins_cmd, "load_plugins", lambda: plugin_set)
    # The table may wrap the cell (the console's width is fixed when it is first built):
    # compare its text without the wrapping.
    cells = re.sub(r"[\s│]", "", _help(capsys, "plugins", "list"))
    assert "error:TypeError:list[int][/]" in cells


def test_usage_errors_are_one_line_with_exit_code_2() -> None:
    cases = {
        ("serve", "--port", "abc"): "error: Invalid value for '--port'",
        ("serve", "--bogus"): "error: No such option: --bogus",
        ("serve", "--print-config", "--l2-adapter", "{oops"): "error: --l2-adapter #1 is not valid JSON",
        ("serve", "--print-config", "--l2-adapter", '{"type": "mokc"}'): "did you mean 'mock'?",
        (
            "serve",
            "--print-config",
            "--eviction-ratio",
            "2",
        ): "error: --eviction-ratio: Expected `float` <= 1.0 - at `$.eviction_ratio`",
        ("serve", "--print-config", "--host", "0.0.0.0"): "requires --auth-token",
        # the HTTP endpoint's own address, named by its flag
        (
            "serve",
            "--print-config",
            "--metrics-host",
            "0.0.0.0",
        ): "error: --metrics-host 0.0.0.0: serving HTTP on it",
        (
            "serve",
            "--print-config",
            "--metrics-host",
            "",
        ): "error: --metrics-host: Expected `str` of length >= 1",
        ("serve", "--config", "/nonexistent.toml"): "config file '/nonexistent.toml' does not exist",
        ("plugins", "show", "nope"): "error: no plugin or component named 'nope'",
        ("status", "--max-workers", "2"): "error: No such option: --max-workers",
    }
    for args, message in cases.items():  # all refused before a server starts: in this process
        result = run_cli_in_process(list(args))
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_a_bad_default_l2_variable_fails_serve_not_every_command() -> None:
    # The serve help describes the default L2 and is built for every command.
    env = {"LMCACHE_TIERS_CACHE_GB": "abc"}
    listed = run_cli(["plugins", "list", "--json"], **env)
    assert listed.returncode == 0, listed.stderr
    served = run_cli(["serve", "--print-config"], **env)
    assert served.returncode == 2
    assert served.stderr.strip().endswith(
        "LMCACHE_TIERS_CACHE_GB='abc' must be a positive number of GiB, at most 1073741824"
    )


def test_a_default_l2_directory_that_cannot_be_probed_fails_no_other_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Sizing the default L2 stats its directory: a name too long for the filesystem is an
    # OSError there, and the serve help describing that L2 is built for every command.
    monkeypatch.setenv("LMCACHE_TIERS_CACHE_DIR", str(tmp_path / ("a" * 300) / "x"))
    assert '"plugin": "fs"' in _help(capsys, "plugins", "list", "--json")
    assert "cannot be used as configured (" in _help(capsys, "serve", "--help")
    served = run_cli(["serve", "--print-config"], LMCACHE_TIERS_CACHE_DIR=str(tmp_path / ("a" * 300)))
    assert served.returncode == 2 and "Traceback" not in served.stderr
    assert re.match(
        r"error: the embedded default L2 in .* cannot be used \(\[Errno 36\] File name too long",
        served.stderr,
    )


def test_a_default_l2_directory_on_a_filesystem_of_no_size_is_named_as_such() -> None:
    # /proc: a share of its 0 bytes was a capacity of 0, refused as a max_capacity_gb nobody set
    served = run_cli(["serve", "--print-config"], LMCACHE_TIERS_CACHE_DIR="/proc/lmcache-tiers")
    assert served.returncode == 2 and "Traceback" not in served.stderr
    assert served.stderr.startswith(
        "error: the embedded default L2 in /proc/lmcache-tiers/l2 cannot be used (/proc/lmcache-tiers/l2 "
        "is on a filesystem of 0 bytes, not a disk); point LMCACHE_TIERS_CACHE_DIR at a writable"
    ), served.stderr
    assert "max_capacity_gb" not in served.stderr


def test_plugins_show_lists_the_components_of_a_plugin_whose_only_failure_was_its_commands(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its components registered and serve can use them: "did not load" and exit 1 would
    # say otherwise. A warning names the failure; the components are shown.
    import typer

    from lmcache_tiers.cli.main import add_plugin_commands

    @hookimpl
    def tiers_register_l2_adapters(registry):  # type: ignore[no-untyped-def]
        registry.add("circuit", "json:dumps", CircuitConfig)

    @hookimpl
    def tiers_register_commands(app):  # type: ignore[no-untyped-def]
        raise RuntimeError("no GPU here")

    plugin = types.ModuleType("circuit")
    plugin.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    plugin.tiers_register_commands = tiers_register_commands  # type: ignore[attr-defined]
    plugin_set = discover({"lmcache-plugin-circuit": plugin})
    add_plugin_commands(typer.Typer(), plugin_set)
    capsys.readouterr()
    monkeypatch.setattr(plugins_cmd, "load_plugins", lambda: plugin_set)
    main(["plugins", "show", "lmcache-plugin-circuit"])
    captured = capsys.readouterr()
    assert "size_gb" in captured.out
    assert captured.err.strip() == (
        "warning: plugin 'lmcache-plugin-circuit': its commands failed to register: RuntimeError: no GPU here"
    )


@pytest.mark.parametrize(
    ("entry_point", "missing"),
    [
        ("tiers_no_such_module", "module 'tiers_no_such_module' is not installed"),
        ("json:no_such_attribute", "module 'json' has no attribute 'no_such_attribute'"),
        (
            "tiers_needs_a_dependency",
            "module 'tiers_needs_a_dependency' imports 'tiers_no_such_dependency', which is not installed",
        ),
    ],
    ids=["module", "attribute", "dependency"],
)
def test_plugins_show_of_an_entry_point_that_cannot_load_names_it_and_what_is_missing(
    tmp_path: Any, entry_point: str, missing: str
) -> None:
    # A distribution whose entry point names what is not there (a half-uninstalled or
    # renamed package): one line naming the distribution, the entry point and what is
    # missing, and a non-zero exit.
    dist = tmp_path / "tiers_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tiers-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\nbroken = {entry_point}\n")
    (tmp_path / "tiers_needs_a_dependency.py").write_text("import tiers_no_such_dependency\n")
    result = run_cli(["plugins", "show", "broken"], site=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: plugin 'broken' did not load: "), lines[0]
    assert f"entry point 'broken = {entry_point}' of distribution 'tiers-broken' 1.0" in lines[0], lines[0]
    assert lines[0].endswith(missing), lines[0]
