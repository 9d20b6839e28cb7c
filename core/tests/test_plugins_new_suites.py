"""What ``lmcache-tiers plugins new`` writes for tests: the conformance suite of the kind.

docs/plugin-guide.md promises that ``pytest <name>/tests`` of a generated package runs
"the conformance suite of its kind"; a hand-written check in its place tests far less
(the serde suite alone checks chain positions, read-only inputs, threads, another
instance's decoding, foreign input).  Running the generated tests is done through an
installed package elsewhere; this reads what is written.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmcache_tiers.plugin as plugin_api
from lmcache_tiers.cli.plugins_new import SkeletonKind, plugin_values, write_plugin

SUITES = {
    SkeletonKind.L2: "L2AdapterSuite",
    SkeletonKind.STORE: "StorePolicySuite",
    SkeletonKind.PREFETCH: "PrefetchPolicySuite",
    SkeletonKind.EVICTION: "EvictionPolicySuite",
    SkeletonKind.SERDE: "SerdeSuite",
    SkeletonKind.FRONTEND: "FrontendSuite",
}


def test_every_kind_has_its_suite_named_here() -> None:
    assert set(SUITES) == set(SkeletonKind)
    for suite in SUITES.values():
        assert suite in plugin_api.__all__, suite


@pytest.mark.parametrize("kind", list(SkeletonKind), ids=lambda kind: kind.value)
def test_the_generated_test_subclasses_the_conformance_suite_of_its_kind(
    kind: SkeletonKind, tmp_path: Path
) -> None:
    name = f"guide-{kind.value}"
    target = write_plugin(name, kind, tmp_path)
    values = plugin_values(name, kind)
    tree = ast.parse((target / "tests" / f"test_{values['component']}.py").read_text())
    tests = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test")]
    bases = {base.id for test in tests for base in test.bases if isinstance(base, ast.Name)}
    assert SUITES[kind] in bases, f"{kind.value}: the generated tests subclass {sorted(bases)}"
    imported = {
        alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "lmcache_tiers.plugin"
        for alias in node.names
    }
    assert SUITES[kind] in imported
    readme = (target / "README.md").read_text()
    assert f"subclasses `{SUITES[kind]}`" in readme, readme
