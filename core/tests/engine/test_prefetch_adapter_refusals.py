"""An adapter whose calls raise fails every prefetch alike: each failure is counted, and
the log says so in one line per burst per adapter, not one line per request."""

from __future__ import annotations

import logging

import pytest
from engine_support import GatedConfig, keys_of, store_in_l2_only

from lmcache_tiers.config import AdapterSpec

SIZE = 32 * 1024
PREFETCHES = 5


def _raise(*args: object, **kwargs: object) -> None:
    raise ConnectionError("the adapter is down")


def _lines_naming(caplog: pytest.LogCaptureFixture, reason: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if reason in record.getMessage()]


@pytest.mark.parametrize(
    ("method", "reason"),
    [
        ("submit_lookup_and_lock", "l2_lookup_submit_error"),
        ("submit_load", "l2_load_submit_error"),
        ("unlock", "l2_unlock_error"),
    ],
)
def test_an_adapter_call_failing_for_every_prefetch_is_one_line(
    engine, monkeypatch, caplog, method: str, reason: str
) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    prompts = [keys_of(300 + prompt, 2) for prompt in range(PREFETCHES)]
    for keys in prompts:
        store_in_l2_only(storage, keys, SIZE)
    monkeypatch.setattr(storage.adapters[0], method, _raise)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.controllers"):
        for keys in prompts:
            handle = storage.submit_prefetch(keys)
            hits = storage.wait_prefetch(handle, 10)
            assert hits is not None
            if hits:
                storage.release(keys[:hits])
    assert storage.stats.failures().get(reason) == PREFETCHES
    lines = _lines_naming(caplog, reason)
    assert len(lines) == 1, lines
    assert "the adapter is down" in lines[0]
