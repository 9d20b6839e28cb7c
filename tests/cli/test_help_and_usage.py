"""Help and usage conventions: -h everywhere, defaults shown, no value placeholder on
switches, lists of installed components from the registry, usage errors exit 2 in one line."""

from __future__ import annotations

import re
from typing import Any

import pytest
from thirdparty import run_cli

from lmcache_tiers.cli.main import build_app, command_tree, main
from lmcache_tiers.config import ServerConfig
from lmcache_tiers.plugins import load_plugins
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
        ("serve", "--config", "/nonexistent.toml"): "config file '/nonexistent.toml' does not exist",
        ("plugins", "show", "nope"): "error: no plugin or component named 'nope'",
        ("status", "--max-workers", "2"): "error: No such option: --max-workers",
    }
    for args, message in cases.items():
        result = run_cli(list(args))
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
