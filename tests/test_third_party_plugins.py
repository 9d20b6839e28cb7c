"""A plugin from outside the repository plugs in through its entry point alone."""

import json
from pathlib import Path

import pytest
from thirdparty import pip_install_to, run_cli, write_package

ACME = '''
import msgspec
from typing import Annotated
from lmcache_tiers.plugin import ComponentConfig, L2AdapterConfig, hookimpl

class AcmeConfig(L2AdapterConfig):
    """Acme tape library."""
    slots: Annotated[int, msgspec.Meta(gt=0, description="Tape slots.")] = 4

class AcmePolicyConfig(ComponentConfig):
    """Acme policy."""

@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("acme_tape", "acme_tiers.impl:AcmeAdapter", AcmeConfig)

@hookimpl
def tiers_register_eviction_policies(registry):
    registry.add("acme_fifo", "acme_tiers.impl:Fifo", AcmePolicyConfig)

@hookimpl
def tiers_register_store_policies(registry):
    registry.add("acme_store", "acme_tiers.impl:Store", AcmePolicyConfig)

@hookimpl
def tiers_register_prefetch_policies(registry):
    registry.add("acme_prefetch", "acme_tiers.impl:Prefetch", AcmePolicyConfig)
'''

BROKEN = """
raise ImportError("acme-broken needs libtape.so")
"""

POLICY_FLAGS = [
    "--eviction-policy",
    "acme_fifo",
    "--l2-store-policy",
    "acme_store",
    "--l2-prefetch-policy",
    "acme_prefetch",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pkgs")
    target = root / "site"
    pip_install_to(target, write_package(root, "acme-tiers", "acme_tiers", ACME))
    pip_install_to(target, write_package(root, "acme-broken", "acme_broken", BROKEN))
    return target


def _by_name(output: str) -> dict[str, dict[str, object]]:
    return {row["plugin"]: row for row in json.loads(output)}


def test_installed_plugin_is_listed(site: Path) -> None:
    result = run_cli(["plugins", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    rows = _by_name(result.stdout)
    acme = rows["acme-tiers"]
    assert acme["status"] == "ok" and acme["version"] == "1.2.3"
    assert "l2_adapter:acme_tape" in acme["components"]  # type: ignore[operator]


def test_plugin_that_raises_on_import_is_reported_and_others_load(site: Path) -> None:
    rows = _by_name(run_cli(["plugins", "list", "--json"], site).stdout)
    assert rows["acme-broken"]["status"] == "error: ImportError: acme-broken needs libtape.so"
    assert rows["acme-tiers"]["status"] == "ok"
    table = run_cli(["plugins", "list"], site, COLUMNS="200")
    assert table.returncode == 0 and "acme-broken" in table.stdout and "libtape.so" in table.stdout


def test_third_party_adapter_selected_by_type_without_core_changes(site: Path) -> None:
    result = run_cli(
        [
            "serve",
            "--print-config",
            "--no-default-l2",
            *POLICY_FLAGS,
            "--l2-adapter",
            '{"type": "acme_tape", "slots": 9}',
        ],
        site,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["l2_adapters"] == [{"type": "acme_tape", "eviction": None, "serde": [], "slots": 9}]


def test_third_party_field_errors_keep_the_path(site: Path) -> None:
    result = run_cli(
        ["serve", "--print-config", *POLICY_FLAGS, "--l2-adapter", '{"type": "acme_tape", "slots": 0}'], site
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: acme_tape: Expected `int` >= 1 - at `$.l2_adapters[0].slots`"


def test_strict_refuses_to_start_with_a_broken_plugin(site: Path) -> None:
    result = run_cli(["serve", "--strict", "--print-config", *POLICY_FLAGS], site)
    assert result.returncode == 2
    assert "--strict: plugins failed to load: acme-broken" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_disabled_plugin_is_not_imported(site: Path) -> None:
    rows = _by_name(
        run_cli(
            ["plugins", "list", "--json"], site, LMCACHE_TIERS_DISABLE_PLUGINS="acme-broken, other"
        ).stdout
    )
    assert rows["acme-broken"]["status"] == "disabled by LMCACHE_TIERS_DISABLE_PLUGINS"
    result = run_cli(
        ["serve", "--strict", "--print-config", *POLICY_FLAGS],
        site,
        LMCACHE_TIERS_DISABLE_PLUGINS="acme-broken",
    )
    assert result.returncode == 0, result.stderr


def test_plugins_show_prints_fields(site: Path) -> None:
    result = run_cli(["plugins", "show", "acme-tiers"], site, COLUMNS="200")
    assert result.returncode == 0, result.stderr
    for text in ("l2_adapter:acme_tape", "slots", "integer", "> 0", "Tape slots.", "eviction"):
        assert text in result.stdout
    by_component = run_cli(["plugins", "show", "acme_tape"], site, COLUMNS="200")
    assert "Tape slots." in by_component.stdout
    broken = run_cli(["plugins", "show", "acme-broken"], site)
    assert broken.returncode == 1 and "did not load" in broken.stderr
    missing = run_cli(["plugins", "show", "nothing-here"], site)
    assert missing.returncode == 1 and "no plugin or component named 'nothing-here'" in missing.stderr


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
        ): "Expected `float` <= 1.0 - at `$.eviction_ratio`",
        ("serve", "--print-config", "--host", "0.0.0.0"): "requires --auth-token",
        ("serve", "--config", "/nonexistent.toml"): "config file '/nonexistent.toml' does not exist",
    }
    for args, message in cases.items():
        result = run_cli(list(args))
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr
