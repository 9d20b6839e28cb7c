"""What the tests of records changed behind a real server's back share: waiting for the
L2 stores, reading each key alone with its bytes checked, and what /metrics and the log
say about the refused records."""

from __future__ import annotations

import re
import time

from tiers_e2e import digest

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey


def wait_stored(client: Client, count: int) -> None:
    """Until the first adapter has stored ``count`` keys (at most a minute)."""
    deadline = time.monotonic() + 60
    while client.status()["adapters"][0]["keys_stored"] < count:
        assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
        time.sleep(0.05)


def read_each(client: Client, keys: list[ObjectKey], expected: list[str]) -> list[bool]:
    """Whether each key hit (alone); every hit's bytes checked against what was stored."""
    hits = []
    for key, want in zip(keys, expected, strict=True):
        found = client.lookup([key])
        if found:
            with client.retrieve([key]) as views:
                assert digest(views) == [want], f"{key.file_stem()}: wrong bytes handed out"
        hits.append(bool(found))
    return hits


def exported(text: str, stats: tuple[str, ...]) -> float:
    """The sum of the adapter stats ``stats`` as /metrics exports them."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r'lmcache_tiers_adapter_stat\{[^}]*stat="([a-z_]+)"[^}]*\} (\S+)$', line)
        if match and match.group(1) in stats:
            total += float(match.group(2))
    return total


def warned_about(log: str, keys: list[ObjectKey]) -> list[str]:
    """The keys a WARNING line of ``log`` names."""
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    return [key.file_stem() for key in keys if any(key.file_stem() in line for line in warnings)]


def damaged_served(
    client: Client, keys: list[ObjectKey], expected: list[str], labels: list[str], what: str
) -> list[str]:
    """Read back ``keys`` stored with ``expected`` digests, the first and the last intact
    and those between damaged (named by ``labels``), out of L1: a lookup of them all
    promises at most the intact first and hands out its bytes; then each key alone
    (``read_each``: a hit has the stored bytes). The labels of the damaged keys served."""
    found = client.lookup(keys)
    assert found <= 1
    with client.retrieve(keys[:found]) as views:
        assert digest(views) == expected[:found]
    hits = read_each(client, keys, expected)
    assert hits[0] and hits[-1], f"an intact {what} was lost"
    return [label for label, hit in zip(labels, hits[1:-1], strict=True) if hit]
