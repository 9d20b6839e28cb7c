"""What ``serve --help`` says ``--strict`` refuses is what it refuses."""

from __future__ import annotations

from lmcache_tiers.cli.main import build_app, command_tree


def _strict_help() -> str:
    serve = command_tree(build_app()).commands["serve"]
    (option,) = [param for param in serve.params if param.name == "strict"]
    return " ".join(option.help.split())


def test_strict_help_names_both_things_it_refuses() -> None:
    # run_serve fails on plugin_set.errors and on plugin_set.contest_lines() alike
    # (tests/cli/test_broken_plugins.py, tests/test_plugin_name_conflicts.py).
    help_text = _strict_help()
    assert "failed to load" in help_text
    assert "component name is registered by two distributions" in help_text
