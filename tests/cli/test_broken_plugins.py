"""What ``serve`` and ``plugins`` do with an installed plugin that is broken.

Two kinds of broken: a module that raises while it is imported, and a registration hook
that raises.  A configuration naming a component such a plugin would provide is refused
with one line naming the plugin and its error (exit 2); a broken plugin the configuration
does not use is one warning line, and the server starts anyway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from thirdparty import run_cli

BROKEN_IMPORT = 'raise ImportError("needs libtape.so")\n'

BROKEN_HOOK = """
from lmcache_tiers.plugin import hookimpl


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("tape", "tiers_badhook_mod:TapeBackend")
    raise RuntimeError("the tape library is not configured")
"""


def _install(site: Path, name: str, module: str, source: str) -> None:
    """An installed distribution ``tiers-<name>`` whose entry point ``name`` is ``module``."""
    dist = site / f"tiers_{name}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tiers-{name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(source)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken-site")
    _install(root, "brokenimport", "tiers_brokenimport_mod", BROKEN_IMPORT)
    _install(root, "badhook", "tiers_badhook_mod", BROKEN_HOOK)
    return root


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_config_naming_a_component_of_a_broken_plugin_is_refused_naming_the_plugin(site: Path) -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--l2-adapter", '{"type": "tape"}'], site)
    assert result.returncode == 2, result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("error: unknown l2 adapter 'tape'"), line
    assert "badhook: RuntimeError: the tape library is not configured" in line, line
    assert "brokenimport: ImportError: needs libtape.so" in line, line


def test_a_broken_plugin_the_config_does_not_use_is_one_warning_and_serve_goes_on(site: Path) -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2"], site)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, result.stderr
    assert "plugin badhook failed to load" in warnings[0] and "tape library" in warnings[0], warnings
    assert "plugin brokenimport failed to load" in warnings[1] and "libtape.so" in warnings[1], warnings
    assert '"l1_size_gb"' in result.stdout


def test_strict_still_refuses_any_broken_plugin(site: Path) -> None:
    result = run_cli(["serve", "--strict", "--print-config", "--no-default-l2"], site)
    assert result.returncode == 2
    line = _one_line(result.stderr)
    assert "--strict: plugins failed to load: badhook" in line and "brokenimport" in line, line


def test_plugins_reference_warns_of_the_plugins_it_cannot_document(site: Path) -> None:
    result = run_cli(["plugins", "reference"], site)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and "badhook" in warnings[0] and "brokenimport" in warnings[1], result.stderr
    assert "fault_inject" in result.stdout


@pytest.mark.parametrize("name", ["brokenimport", "badhook"])
def test_plugins_show_of_a_broken_plugin_is_one_error_line(site: Path, name: str) -> None:
    result = run_cli(["plugins", "show", name], site)
    assert result.returncode == 1
    assert _one_line(result.stderr).startswith(f"error: plugin {name!r} did not load: "), result.stderr


def test_plugins_list_shows_broken_plugins_and_exits_0(site: Path) -> None:
    result = run_cli(["plugins", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    assert '"status": "error: ImportError: needs libtape.so"' in result.stdout
    assert '"status": "error: RuntimeError: the tape library is not configured"' in result.stdout


def test_plugins_without_a_command_or_show_without_a_name_is_a_usage_error(site: Path) -> None:
    assert run_cli(["plugins"], site).returncode == 2
    bare = run_cli(["plugins", "show"], site)
    assert bare.returncode == 2 and _one_line(bare.stderr) == "error: Missing argument 'name'."
