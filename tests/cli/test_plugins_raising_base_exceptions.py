"""An installed plugin that raises what is no ``Exception`` while it is imported or
registers -- a BaseException of its own, a GeneratorExit -- is a broken plugin like one
raising an ImportError: ``plugins list`` shows it with its error next to every other
plugin, and ``serve`` refuses a configuration naming its component in one line naming the
plugin.  Neither command dies with a traceback that lists no plugin at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from thirdparty import install_flat_plugin, run_cli

ABORT_ON_IMPORT = """
class PluginAbort(BaseException):
    pass


raise PluginAbort("no licence server")
"""

ABORT_IN_HOOK = """
from lmcache_tiers.plugin import hookimpl


class PluginAbort(BaseException):
    pass


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("tape", "tiers_aborthook_mod:TapeBackend")
    raise PluginAbort("the tape robot is offline")
"""

GENERATOR_EXIT_IN_HOOK = """
from lmcache_tiers.plugin import hookimpl


@hookimpl
def tiers_register_serdes(registry):
    raise GeneratorExit("closed early")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("aborting-site")
    install_flat_plugin(root, "abortimport", "tiers_abortimport_mod", ABORT_ON_IMPORT)
    install_flat_plugin(root, "aborthook", "tiers_aborthook_mod", ABORT_IN_HOOK)
    install_flat_plugin(root, "genexithook", "tiers_genexithook_mod", GENERATOR_EXIT_IN_HOOK)
    return root


def test_plugins_list_shows_each_aborting_plugin_with_its_error_and_every_other_plugin(site: Path) -> None:
    result = run_cli(["plugins", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    listed = {plugin["plugin"]: plugin for plugin in json.loads(result.stdout)}
    assert listed["abortimport"]["status"] == "error: PluginAbort: no licence server", listed["abortimport"]
    assert listed["aborthook"]["status"] == "error: PluginAbort: the tape robot is offline", listed[
        "aborthook"
    ]
    assert listed["genexithook"]["status"] == "error: GeneratorExit: closed early", listed["genexithook"]
    assert listed["mock"]["status"] == "ok", "the other plugins are still listed"


def test_serve_refuses_a_component_of_an_aborting_plugin_in_one_line_naming_it(site: Path) -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--l2-adapter", '{"type": "tape"}'], site)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: unknown l2 adapter 'tape'"), lines[0]
    assert "aborthook: PluginAbort: the tape robot is offline" in lines[0], lines[0]
    assert "abortimport: PluginAbort: no licence server" in lines[0], lines[0]
