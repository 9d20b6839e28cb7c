"""The "HTTP endpoint" section of docs/server.md is where an operator wiring Prometheus
looks for what /metrics exports: it names every family itself (not only some other
section of the page), and the labels it gives a family are the ones the family has.

test_metrics_documented.py checks names across the whole page; a family named only in
another section, or a label written wrong, passes there.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from tiers_e2e import ServerProcess, fetch, make_keys, make_payloads

from lmcache_tiers.client import Client

ROOT = Path(__file__).resolve().parents[2]
SERVER_DOC = ROOT / "docs" / "server.md"
PREFIX = "lmcache_tiers_"
#: a backticked name with its labels: `requests_total{frontend="0:native",op="Lookup"}`
LABELLED = re.compile(r"`(?:lmcache_tiers_)?([a-z][a-z0-9_]*)\{([^`}]*)\}`")
#: one label of a documented set: a name, alone or with one value or alternatives
LABEL = re.compile(r'([a-z_]+)(?:=((?:"[^"]*"\|?)+))?')
#: labels whose documented values are examples of what happens, not values a fresh server has
OPEN_VALUES = {"reason"}


def http_section() -> str:
    text = SERVER_DOC.read_text()
    start = text.index("\n## HTTP endpoint\n")
    return text[start : text.index("\n## ", start + 1)]


def scrape_after_traffic(server: ServerProcess) -> dict[str, tuple[str, dict[str, set[str]]]]:
    """Each family of a scrape (prefix removed, counters with ``_total``): its type and,
    per label, the values its samples carry."""
    tag = "section"
    with Client(server.url) as client:
        assert client.store(make_keys(tag, 2), make_payloads(tag, 2, 4096)) == 2
        assert client.lookup(make_keys(tag, 2)) == 2
        client.release(make_keys(tag, 2))
    assert server.http_url is not None
    assert fetch(f"{server.http_url}/no-such-route")[0] == 404  # a failure reason to label
    status, _, body = fetch(f"{server.http_url}/metrics")
    assert status == 200
    families: dict[str, tuple[str, dict[str, set[str]]]] = {}
    for family in text_string_to_metric_families(body):
        name = family.name.removeprefix(PREFIX)
        name += "_total" if family.type == "counter" else ""
        if family.type == "info":
            name += "_info"
        labels: dict[str, set[str]] = {}
        for sample in family.samples:
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
        families[name] = (family.type, labels)
    return families


def test_the_http_section_names_every_family_with_its_labels(server_with_l2: ServerProcess) -> None:
    section = http_section()
    families = scrape_after_traffic(server_with_l2)
    unnamed = sorted(name for name in families if not re.search(rf"`(?:{PREFIX})?{name}[`{{]", section))
    assert unnamed == [], f"families /metrics exports that the HTTP endpoint section does not name: {unnamed}"

    wrong: list[str] = []
    documented_labels: dict[str, set[str]] = {}
    for match in LABELLED.finditer(section):
        name, labels = match.group(1), match.group(2)
        if name not in families:
            wrong.append(f"{match.group(0)}: no such family")
            continue
        exported = families[name][1]
        for label, values in LABEL.findall(labels.replace(" ", "")):
            documented_labels.setdefault(name, set()).add(label)
            if label not in exported:
                wrong.append(f"{match.group(0)}: {name} has no label {label!r} (it has {sorted(exported)})")
            elif values and label not in OPEN_VALUES:
                missing = set(re.findall(r'"([^"]*)"', values)) - exported[label]
                if missing:
                    wrong.append(f"{match.group(0)}: {label} never {sorted(missing)}")
    # a label a family has that no mention of it names
    for name, (_, exported) in families.items():
        if name in documented_labels and set(exported) - documented_labels[name]:
            wrong.append(f"{name}: labels {sorted(set(exported) - documented_labels[name])} never named")
    assert wrong == [], wrong
