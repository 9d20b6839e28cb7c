"""A component name two installed distributions register is used by neither: a command
whose configuration uses it exits 2 with one line naming the name and both distributions,
``plugins list`` shows the conflict, and a configuration that does not use it still works.

Before, the distribution whose entry point sorted first kept the name (the other was
listed as broken), so a plugin named to sort before ``fs`` took the default L2 and every
acknowledged write with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_helpers import small_trace
from thirdparty import install_flat_plugin, run_cli

#: takes over `fs` (the default L2's type), with the shipped adapter's own config and
#: backend so that nothing but the name tells it apart; and registers `twin`
SHADOW_FS = """
from lmcache_plugin_fs import FsConfig
from lmcache_tiers.plugin import hookimpl


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("fs", "lmcache_plugin_fs.backend:FsBackend", FsConfig)
    registry.add("twin", "lmcache_plugin_mock.backend:MockBackend", _mock_config())
    registry.add("shadow_only", "lmcache_plugin_mock.backend:MockBackend", _mock_config())


def _mock_config():
    from lmcache_plugin_mock import MockConfig

    return MockConfig
"""

#: registers `twin` as well
TWIN = """
from lmcache_plugin_mock import MockConfig
from lmcache_tiers.plugin import hookimpl


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("twin", "lmcache_plugin_mock.backend:MockBackend", MockConfig)
"""

WAY_OUT = "uninstall one of them (or disable one with LMCACHE_TIERS_DISABLE_PLUGINS)"
FS_CONTEST = (
    "l2 adapter 'fs' is registered by both 'tiers-aaa-shadow-fs' and 'lmcache-plugin-fs'; "
    f"none of them is used; {WAY_OUT}"
)
TWIN_CONTEST = (
    "l2 adapter 'twin' is registered by both 'tiers-aaa-shadow-fs' and 'tiers-zzz-twin'; "
    f"none of them is used; {WAY_OUT}"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("conflicts")
    # "aaa-..." sorts before "fs": the entry point that used to keep the name
    install_flat_plugin(target, "aaa-shadow-fs", "tiers_shadow_fs", SHADOW_FS)
    install_flat_plugin(target, "zzz-twin", "tiers_twin", TWIN)
    return target


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_serve_with_the_default_l2_refuses_a_taken_over_fs(site: Path, tmp_path: Path) -> None:
    result = run_cli(["serve", "--print-config"], site, LMCACHE_TIERS_CACHE_DIR=str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert _error_line(result.stderr) == f"error: {FS_CONTEST}"


def test_serve_naming_a_contested_type_names_both_distributions(site: Path) -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--l2-adapter", '{"type": "twin"}'], site)
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_line(result.stderr).startswith(f"error: {TWIN_CONTEST} - at `$.l2_adapters[0].type`")


def test_a_configuration_not_using_a_contested_name_still_serves(site: Path) -> None:
    args = ["serve", "--print-config", "--no-default-l2", "--l2-adapter", '{"type": "shadow_only"}']
    result = run_cli(args, site, COLUMNS="400")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["l2_adapters"][0]["type"] == "shadow_only"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert sorted(warnings) == sorted(
        f"warning: {line} (--strict refuses to start)" for line in (FS_CONTEST, TWIN_CONTEST)
    )
    strict = run_cli([*args, "--strict"], site, COLUMNS="400")
    assert strict.returncode == 2
    assert _error_line(strict.stderr) == f"error: --strict: {FS_CONTEST}; {TWIN_CONTEST}"


def test_plugins_list_shows_each_conflict_on_both_plugins(site: Path) -> None:
    result = run_cli(["plugins", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    rows = {row["plugin"]: row for row in json.loads(result.stdout)}
    assert rows["fs"]["status"] == (
        f"conflict: l2_adapter:fs is also registered by 'tiers-aaa-shadow-fs'; {WAY_OUT}"
    )
    assert rows["aaa-shadow-fs"]["status"] == (
        "conflict: l2_adapter:fs is also registered by 'lmcache-plugin-fs'; "
        f"l2_adapter:twin is also registered by 'tiers-zzz-twin'; {WAY_OUT}"
    )
    assert rows["zzz-twin"]["status"].startswith("conflict: l2_adapter:twin is also registered by")
    assert "l2_adapter:fs" in rows["fs"]["components"]


def test_replay_in_process_refuses_a_contested_type(site: Path, tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    spec = json.dumps({"type": "fs", "path": str(tmp_path / "l2"), "max_capacity_gb": 0.01})
    args = ["replay", str(trace), "--in-process", "--l1-size-gb", "0.05", "--l2-adapter", spec]
    result = run_cli(args, site)
    assert result.returncode == 2, result.stdout + result.stderr
    assert _error_line(result.stderr).startswith(f"error: {FS_CONTEST}")


def test_disabling_one_of_them_gives_the_name_back(site: Path, tmp_path: Path) -> None:
    result = run_cli(
        ["serve", "--print-config"],
        site,
        LMCACHE_TIERS_CACHE_DIR=str(tmp_path),
        LMCACHE_TIERS_DISABLE_PLUGINS="aaa-shadow-fs",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["l2_adapters"][0]["type"] == "fs"


def test_plugins_show_of_either_plugin_lists_the_contested_component(site: Path) -> None:
    for plugin, distribution in (("fs", "lmcache-plugin-fs"), ("aaa-shadow-fs", "tiers-aaa-shadow-fs")):
        result = run_cli(["plugins", "show", plugin], site, COLUMNS="400")
        assert result.returncode == 0, result.stderr
        assert f"l2_adapter:fs  (plugin {distribution})" in result.stdout
        assert f"warning: {FS_CONTEST}" in result.stderr.splitlines()


def test_plugins_show_of_a_contested_component_lists_each_claimant_under_one_warning(site: Path) -> None:
    result = run_cli(["plugins", "show", "l2_adapter:twin"], site, COLUMNS="400")
    assert result.returncode == 0, result.stderr
    for distribution in ("tiers-aaa-shadow-fs", "tiers-zzz-twin"):
        assert f"l2_adapter:twin  (plugin {distribution})" in result.stdout
    assert result.stderr.splitlines() == [f"warning: {TWIN_CONTEST}"]


def test_plugins_reference_documents_every_claimant_of_a_contested_name(site: Path) -> None:
    """The reference documented a name from the distribution that registered it first
    only -- here the third-party one, which the reference leaves out, so the shipped `fs`
    had no section at all -- and said nothing of serve refusing the name."""
    result = run_cli(["plugins", "reference"], site)
    assert result.returncode == 0, result.stderr
    sections = result.stdout.split("\n### ")
    for distribution in ("lmcache-plugin-fs", "tiers-aaa-shadow-fs"):
        found = [s for s in sections if s.startswith(f"`fs` ({distribution})\n")]
        assert len(found) == 1, (distribution, result.stdout)
        assert f"**Contested name:** {FS_CONTEST.split('; none')[0]}; none of them is used" in found[0]
        assert "`serve` refuses a configuration that uses `fs`" in found[0]
        assert "| `path` |" in found[0], found[0]  # each claimant's options (FsConfig here)
    # a name no shipped plugin registers stays out, contested or not (third-party plugins
    # are listed live, by `plugins show`)
    assert not any(s.startswith("`twin`") or s.startswith("`shadow_only`") for s in sections)
    assert f"warning: {FS_CONTEST}" in result.stderr.splitlines()
