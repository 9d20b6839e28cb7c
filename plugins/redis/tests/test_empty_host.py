"""An empty ``host`` (LMCache's ``resp`` field, or an unset variable expanded into the
JSON) names no store: it is refused at its path, as LMCache refuses it, instead of an
adapter that starts and waits for ever for a store it cannot reach."""

from __future__ import annotations

import json

import pytest
from cli_config import print_config


@pytest.mark.parametrize("kind", ["redis", "resp", "valkey"])
@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_host_is_refused(kind: str, host: str) -> None:
    result = print_config({"type": kind, "host": host, "port": 6379})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {kind}: host is empty: give the store's address - at `$.l2_adapters[0].host`"]


def test_a_host_is_still_accepted() -> None:
    result = print_config({"type": "resp", "host": "127.0.0.1", "port": 6379})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["l2_adapters"][0]["host"] == "127.0.0.1"
