"""The line logged for a request left unanswered says what this server did, never that
LMCache's server would have done the same: several refusals are departures from it.

LMCache 0.5.6's server answers a registration whose model name is empty, longer than 256
characters or holds ``@`` (it then serves the first two, and leaves every lookup and
transfer of an ``@`` name unanswered), and it serves LMCache-driven transfers when started
with ``--supported-transfer-mode auto``; this front end refuses all of them.
"""

from __future__ import annotations

import logging

import pytest
from mp_counts import mp_stats
from mpclient import MPClient, Registration

from lmcache_tiers.server.app import TiersServer


@pytest.mark.parametrize("model_name", ["", "a@b", "m" * 300], ids=["empty", "at-sign", "long"])
def test_a_refused_registration_is_not_said_to_be_refused_by_lmcache_too(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture, model_name: str
) -> None:
    registration = Registration(instance_id=7, model_name=model_name).encode()
    with caplog.at_level(logging.WARNING):
        assert client.unanswered("register_kv_cache_engine_driven_context", registration)
    assert mp_stats(mp_server).failures["mp_bad_request"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "mp_bad_request" in r.getMessage()]
    assert "register_kv_cache_engine_driven_context (uid 0) not answered" in line
    assert "LMCache's server would not" not in line


def test_a_refused_lmcache_driven_registration_is_not_said_to_be_refused_by_lmcache_too(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert client.unanswered("register_kv_cache", 1, [], "m", 1, "vllm", {}, [])
    (line,) = [r.getMessage() for r in caplog.records if "mp_not_served" in r.getMessage()]
    assert "register_kv_cache (uid 0) not answered" in line
    assert "LMCache's server would not" not in line
