"""Lists the documents give of names the code defines are the code's lists.

docs/serde.md lists each serde's counters (an operator's alerts are written from it);
docs/plugin-guide.md lists what ``lmcache_tiers.plugin`` offers (a plugin author imports
from it); the Python samples of README.md and docs/ import names that exist.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import lmcache_tiers.plugin as plugin_api
from lmcache_tiers.config import parse_adapter_json
from lmcache_tiers.plugins import load_plugins
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import build_serde_chain

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
BACKTICKED_NAME = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def _section(document: str, start: str, end: str) -> str:
    text = (ROOT / document).read_text()
    return text.split(start, 1)[1].split(end, 1)[0]


def documented_serde_counters() -> dict[str, set[str]]:
    """``{serde: counters}`` from the bullet list of docs/serde.md's Counters section."""
    section = " ".join(_section("docs/serde.md", "## Counters", "\n## ").split())
    listed: dict[str, set[str]] = {}
    for found in re.finditer(r"\* (\w+): (.*?);?(?= \* \w+: |They appear)", section):
        names = set(BACKTICKED_NAME.findall(found.group(2)))
        listed[found.group(1)] = names
    return listed


def test_serde_md_lists_each_serdes_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_TIERS_TEST_KV_KEY", "11" * 32)
    registry = load_plugins().registry
    spec = parse_adapter_json(
        registry,
        '{"type": "mock", "serde": [{"type": "fp8"}, {"type": "zstd"},'
        ' {"type": "aesgcm", "key_env": "LMCACHE_TIERS_TEST_KV_KEY"}]}',
        0,
    )
    chain: list[Any] = build_serde_chain(spec.serde, registry)  # stats() is optional in Serde
    counted = {serde.name: set(serde.stats()) for serde in chain}
    listed = documented_serde_counters()
    assert set(listed) == set(counted)
    for name, counters in counted.items():
        # "the `passthrough_*` reasons above" stands for fp8's passthrough counters
        expected = {c for c in counters if not c.startswith("passthrough_")}
        assert listed[name] == expected, name
    passthrough = " ".join(_section("docs/serde.md", "## fp8", "\n## ").split())
    assert {c for c in counted["fp8"] if c.startswith("passthrough_")} <= set(
        BACKTICKED_NAME.findall(passthrough)
    )


def test_the_plugin_guide_names_only_what_the_plugin_api_exports() -> None:
    table = _section("docs/plugin-guide.md", "## 2. The public API", "## 3.")
    rows = [
        line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "| for |" not in line
    ]
    named = {name for row in rows for name in BACKTICKED_NAME.findall(row)}
    assert len(named) > 80
    missing = sorted(name for name in named if name not in plugin_api.__all__ and not name.startswith("__"))
    assert missing == [], "names docs/plugin-guide.md gives for lmcache_tiers.plugin that it does not export"


def test_the_python_samples_import_names_that_exist() -> None:
    imported = 0
    wrong = []
    for path in DOCUMENTS:
        for block in re.finditer(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M):
            for line in re.finditer(r"^[ \t]*from ([\w.]+) import ([\w, ]+)$", block.group(1), re.M):
                module = importlib.import_module(line.group(1))
                for name in filter(None, (part.strip() for part in line.group(2).split(","))):
                    imported += 1
                    if not hasattr(module, name):
                        wrong.append(f"{path.relative_to(ROOT)}: from {line.group(1)} import {name}")
    assert wrong == []
    assert imported >= 10


def _documented(value: object) -> str:
    """A default as an options table writes it: ``false``, ``20`` for 20.0, ``600``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_lmcache_mp_options_table_gives_the_shipped_defaults() -> None:
    registry = load_plugins().registry
    config = registry.get(Kind.FRONTEND, "lmcache_mp").config()
    defaults = {name: getattr(config, name) for name in config.__struct_fields__}
    table = _section("docs/frontends/lmcache-mp.md", "## Options", "\n## ")
    rows = {
        found.group(1): found.group(2).strip()
        for found in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    }
    assert set(rows) == set(defaults) - {"host", "port"}
    assert {name: rows[name] for name in rows} == {name: _documented(defaults[name]) for name in rows}


def test_readme_describes_every_benchmark_and_what_run_all_leaves_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    run_all = importlib.import_module("run_all")
    scripts = {path.name for path in (ROOT / "bench").glob("bench_*.py") if "__main__" in path.read_text()}
    readme = " ".join((ROOT / "README.md").read_text().split())
    section = readme.split("## Benchmarks", 1)[1].split("## ", 1)[0]
    described = set(re.findall(r"`bench/(bench_\w+\.py)`", section))
    assert described == scripts
    left_out = re.search(r"`bench/run_all.py` runs all of them but (.*?) and writes one report", section)
    assert left_out is not None
    run = {bench.script for bench in run_all.BENCHES}
    assert set(re.findall(r"`(bench_\w+\.py)`", left_out.group(1))) == scripts - run
    assert run <= scripts


def test_server_md_lists_the_native_ops_error_codes_and_features() -> None:
    from lmcache_tiers.wire import protocol

    text = (ROOT / "docs" / "server.md").read_text()
    section = text.split("## Native wire protocol", 1)[1].split("\n## ", 1)[0]
    ops = {
        int(number): name
        for row in re.findall(r"^\| (\d+ [A-Z_]+(?: / \d+ [A-Z_]+)*) \|", section, re.M)
        for number, name in re.findall(r"(\d+) ([A-Z_]+)", row)
    }
    assert ops == {op.value: op.name for op in protocol.Op if op.name != "ERROR"}
    codes = re.search(r"Every reply carries an `ErrorCode` \(([^)]*)\)", " ".join(section.split()))
    assert codes is not None
    assert BACKTICKED_NAME.findall(codes.group(1)) == [code.name for code in protocol.ErrorCode]
    features = re.search(r"HELLO's `features` list \(([^;]*);", " ".join(section.split()))
    assert features is not None
    assert tuple(BACKTICKED_NAME.findall(features.group(1))) == protocol.FEATURES
