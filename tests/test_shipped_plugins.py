"""Every plugin directory in the repository is installed, discoverable and documented."""

import json
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from thirdparty import run_cli

from lmcache_tiers.config_docs import render_config_reference
from lmcache_tiers.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = sorted(
    p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists() and not p.name.startswith("_")
)


def _entry_points(directory: Path) -> dict[str, str]:
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["lmcache_tiers"]


def test_every_shipped_plugin_is_listed_with_components() -> None:
    result = run_cli(["plugins", "list", "--json"])
    assert result.returncode == 0, result.stderr
    rows = {row["plugin"]: row for row in json.loads(result.stdout)}
    assert PLUGIN_DIRS, "no plugins found in the repository"
    for directory in PLUGIN_DIRS:
        project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
        assert project["name"] == f"lmcache-plugin-{directory.name}"
        for name in _entry_points(directory):
            assert name in rows, f"{directory.name}: entry point {name} is not installed"
            assert rows[name]["status"] == "ok", rows[name]
            assert rows[name]["components"], f"{name} registers no component"


def test_configuration_reference_is_current() -> None:
    expected = render_config_reference(load_plugins())
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == expected, (
        "docs/configuration.md is stale: run `lmcache-tiers plugins reference > docs/configuration.md`"
    )


def test_listing_plugins_imports_no_backend_library() -> None:
    """Manifests register "module:attr" strings, so discovery never loads NIXL or torch."""
    import subprocess

    probe = (
        "import sys, lmcache_tiers\n"
        "from lmcache_tiers.plugins import load_plugins\n"
        "assert all(p.status == 'ok' for p in load_plugins().plugins)\n"
        "assert lmcache_tiers.plugin.hookimpl is not None  # the plugin API is as light\n"
        "heavy = ('torch', 'nixl', 'nixl_cu12', 's3fs', 'redis', 'numpy', 'pytest')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tox_lists_one_env_per_plugin_directory() -> None:
    import configparser
    import re

    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    headers = [s for s in parser.sections() if s.startswith("testenv:plugin-")]
    assert len(headers) == 1, "one list of plugin environments"
    match = re.fullmatch(r"testenv:plugin-\{(.+)\}", headers[0])
    assert match is not None
    assert sorted(match.group(1).split(",")) == sorted(d.name for d in PLUGIN_DIRS)


def test_a_plugin_env_installs_the_local_plugins_its_tests_need() -> None:
    import subprocess

    plan = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plugin_env.py"), "plugin-fault-inject", "--plan"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    install, run = plan
    assert f"-e {ROOT / 'plugins' / 'mock'} -e {ROOT / 'plugins' / 'fault-inject'}[test]" in install
    assert "-c " in install and "constraints.txt" in install
    assert run.endswith(f"-m pytest {ROOT / 'plugins' / 'fault-inject'}")


@pytest.mark.parametrize(
    ("adapter", "field", "others"),
    [
        ("fs", "max_capacity_gb", {"path": "/tmp/unused"}),
        ("redis", "max_capacity_gb", {"url": "redis://127.0.0.1:1"}),
        ("s3", "max_capacity_gb", {"bucket": "unused"}),
        ("mooncake_store", "max_capacity_gb", {}),
        ("mock", "max_size_gb", {}),
    ],
)
def test_a_capacity_under_one_byte_is_refused(adapter: str, field: str, others: dict[str, object]) -> None:
    # 0 bytes would refuse every store (fs, mock), or read as "no limit" (redis, s3,
    # mooncake_store, where 0 means that): a setting silently turned into another.
    from lmcache_tiers.config import decode_adapter
    from lmcache_tiers.errors import ConfigError
    from lmcache_tiers.plugins import load_registry

    with pytest.raises(
        ConfigError, match=rf"{field} 1e-12 is under one byte.* - at `\$\.l2_adapters\[0\]\.{field}`$"
    ):
        decode_adapter(load_registry(), {"type": adapter, field: 1e-12, **others}, 0)
    decode_adapter(load_registry(), {"type": adapter, field: 1 / (1 << 30), **others}, 0)  # one byte is taken
