"""What ``serve`` and ``plugins`` do with an installed plugin that is broken.

Two kinds of broken: a module that raises while it is imported, and a registration hook
that raises.  A configuration naming a component such a plugin would provide is refused
with one line naming the plugin and its error (exit 2); a broken plugin the configuration
does not use is one warning line, and the server starts anyway -- and says so in
``/metrics`` (``plugins_failed_to_load``) and ``/status`` for as long as it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from thirdparty import free_port, install_flat_plugin, run_cli, serve_cli
from tiers_e2e import fetch, metric

BROKEN_IMPORT = 'raise ImportError("needs libtape.so")\n'

BROKEN_HOOK = """
from lmcache_tiers.plugin import hookimpl


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("tape", "tiers_badhook_mod:TapeBackend")
    raise RuntimeError("the tape library is not configured")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken-site")
    install_flat_plugin(root, "brokenimport", "tiers_brokenimport_mod", BROKEN_IMPORT)
    install_flat_plugin(root, "badhook", "tiers_badhook_mod", BROKEN_HOOK)
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


def _observe_server(site: Path | None, log_dir: Path) -> tuple[str, dict[str, object], str]:
    """Serve ``--no-default-l2`` with its HTTP endpoint on a free loopback port, and read what
    it says of itself: the /metrics text, the /status document's ``server`` part and what
    ``lmcache-tiers status`` prints (on one wide terminal)."""
    http_port = free_port()
    args = ["--no-default-l2", "--l1-size-gb", "0.0625", "--metrics-port", str(http_port)]
    server = serve_cli(args, site, log_dir)
    try:
        status, _, metrics = fetch(f"http://127.0.0.1:{http_port}/metrics")
        assert status == 200, metrics
        status, _, document = fetch(f"http://127.0.0.1:{http_port}/status")
        assert status == 200, document
        table = run_cli(["status", "--url", server.url], COLUMNS="300")
        assert table.returncode == 0, table.stderr
    finally:
        assert server.stop() == 0, server.output()
    return metrics, json.loads(document)["server"], table.stdout


def _table_row(table: str, label: str) -> str:
    rows = [line for line in table.splitlines() if label in line]
    assert len(rows) == 1, table
    return rows[0]


def test_a_server_started_past_broken_plugins_counts_them_in_metrics_and_status(
    site: Path, tmp_path: Path
) -> None:
    metrics, status, table = _observe_server(site, tmp_path)
    assert metric(metrics, "lmcache_tiers_plugins_failed_to_load") == 2, metrics
    row = _table_row(table, "plugins failed to load")
    assert "badhook (RuntimeError: the tape library is not configured)" in row, table
    assert "brokenimport (ImportError: needs libtape.so)" in row, table
    assert status["plugins_failed_to_load"] == {
        "badhook": "RuntimeError: the tape library is not configured",
        "brokenimport": "ImportError: needs libtape.so",
    }, status


def test_with_no_broken_plugin_the_gauge_is_0_and_status_lists_none(tmp_path: Path) -> None:
    metrics, status, table = _observe_server(None, tmp_path)
    assert metric(metrics, "lmcache_tiers_plugins_failed_to_load") == 0, metrics
    failed = _table_row(table, "plugins failed to load").split("plugins failed to load")[1]
    assert failed.strip(" │|") == "none", table
    assert status["plugins_failed_to_load"] == {}, status


def test_the_status_table_prints_a_plugin_error_as_it_is() -> None:
    from rich.console import Console

    from lmcache_tiers.cli.commands_server import status_tables

    document = {"server": {"plugins_failed_to_load": {"tape": "ImportError: no [bold]libtape[/bold]"}}}
    console = Console(width=300, record=True)
    for table in status_tables(document):
        console.print(table)
    assert "tape (ImportError: no [bold]libtape[/bold])" in console.export_text()
