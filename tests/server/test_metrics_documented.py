"""docs/server.md names every family a running server exports at /metrics, and every
``lmcache_tiers_*`` name the documentation gives is one the server exports.

An operator reads the list in docs/server.md to know what to scrape and alert on: a family
missing from it is invisible to them, and a documented name the server does not export is
an alert that never fires.
"""

from __future__ import annotations

import re
from pathlib import Path

from tiers_e2e import ServerProcess, fetch

ROOT = Path(__file__).resolve().parents[2]
SERVER_DOC = ROOT / "docs" / "server.md"
PREFIX = "lmcache_tiers_"

#: a backticked metric name, with or without the prefix and labels: `requests_total{...}`
BACKTICKED_NAME = re.compile(r"`(?:lmcache_tiers_)?([a-z][a-z0-9_]*)(?:\{[^`]*\})?`")
FULL_NAME = re.compile(r"\blmcache_tiers_[a-z0-9_]*[a-z0-9]\b")


def exported_families(server: ServerProcess) -> set[str]:
    """Names of the families in a scrape (from their ``# TYPE`` lines), prefix removed."""
    assert server.http_url is not None
    status, _, body = fetch(f"{server.http_url}/metrics")
    assert status == 200, body
    names = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    assert names and all(name.startswith(PREFIX) for name in names), names
    return {name.removeprefix(PREFIX) for name in names}


def _documented_names(text: str) -> set[str]:
    names = set(BACKTICKED_NAME.findall(text))
    return names | {name.removesuffix("_total") for name in names}


def test_every_exported_family_is_listed_in_server_md(server_with_l2: ServerProcess) -> None:
    documented = _documented_names(SERVER_DOC.read_text())
    missing = sorted(
        family
        for family in exported_families(server_with_l2)
        if family not in documented and family.removesuffix("_total") not in documented
    )
    assert missing == [], f"families /metrics exports that docs/server.md does not name: {missing}"


def test_every_documented_full_name_is_exported(server_with_l2: ServerProcess) -> None:
    exported = exported_families(server_with_l2)
    known = exported | {family.removesuffix("_total") for family in exported}
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in documents
        for name in set(FULL_NAME.findall(path.read_text()))
        if name.removeprefix(PREFIX) not in known
        # the tour's grep names a prefix of several families
        and not any(family.startswith(name.removeprefix(PREFIX)) for family in exported)
    )
    assert unknown == [], f"documented metric names /metrics does not export: {unknown}"
