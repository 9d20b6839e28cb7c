"""The copy-me skeleton is what ``plugins new`` writes, installs as a plugin and passes its
own conformance tests."""

from pathlib import Path

from plugin_packages import install_and_test
from thirdparty import run_cli

from lmcache_tiers.cli.plugins_new import SkeletonKind, write_plugin

TEMPLATE = Path(__file__).resolve().parents[1] / "plugins" / "_template"


def tree(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path)
    }


def test_the_template_is_what_plugins_new_writes(tmp_path: Path) -> None:
    fresh = write_plugin("template", SkeletonKind.L2, tmp_path)
    assert tree(TEMPLATE) == tree(fresh), (
        "plugins/_template is stale: rm -r plugins/_template && "
        "lmcache-tiers plugins new template --kind l2 --dir plugins && mv plugins/template plugins/_template"
    )


def test_template_installs_lists_and_passes_its_suite(tmp_path: Path) -> None:
    site = tmp_path / "site"
    install_and_test(TEMPLATE, tmp_path / "template", site)
    listed = run_cli(["plugins", "list", "--json"], site)
    assert '"l2_adapter:template"' in listed.stdout
