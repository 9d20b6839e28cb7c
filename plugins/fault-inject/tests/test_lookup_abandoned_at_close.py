"""A lookup the inner adapter has not answered when the wrapper closes is abandoned: counted
as that (``inner_lookup_stopped_closing``), not as a lookup that timed out
(``inner_lookup_timeouts`` means ``lookup_timeout_s`` passed), and the line core logs for
the failed call says the adapter closed, not that a timeout passed."""

from __future__ import annotations

import logging
import threading
import types
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from lmcache_plugin_fault_inject import FaultInjectConfig
from lmcache_plugin_fault_inject.backend import open_fault_inject
from lmcache_plugin_mock import MockConfig
from lmcache_plugin_mock.backend import MockBackend

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, create_adapter
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.testing.l2 import make_keys

#: set by a lookup of :class:`StuckLookups` once it is in the inner backend
_entered = threading.Event()
#: lets the lookups of :class:`StuckLookups` go
_released = threading.Event()


class StuckLookups(MockBackend):
    """The mock, whose lookups say they started and then wait until the test lets them go."""

    def contains_many(self, keys: Sequence[ObjectKey]) -> Any:
        _entered.set()
        _released.wait(60)
        return super().contains_many(keys)


@hookimpl(specname="tiers_register_l2_adapters")
def _register(registry: KindRegistry) -> None:
    registry.add("stuck_lookups", StuckLookups, MockConfig)


def test_a_lookup_left_in_the_inner_adapter_at_close_is_not_a_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = types.ModuleType("fault_inject_stuck_at_close_test")
    module.tiers_register_l2_adapters = _register  # type: ignore[attr-defined]
    registry = discover(extra_plugins={"fault-inject-stuck-at-close-test": module}).registry
    config = FaultInjectConfig(
        inner={"type": "stuck_lookups", "namespace": uuid.uuid4().hex}, lookup_timeout_s=3600.0
    )
    context = AdapterContext(index=0, name="0:fault_inject", config=config)
    _entered.clear()
    _released.clear()
    adapter = create_adapter(open_fault_inject, config, context, registry=registry)
    try:
        task = adapter.submit_lookup_and_lock(make_keys(1))
        assert _entered.wait(60), "the lookup never reached the inner adapter"
        with caplog.at_level(logging.WARNING):
            adapter.close()  # the wrapper gives the lookup up as soon as closing begins
        result = adapter.pop_completed_lookups()[task]
        assert result.found == [False]
    finally:
        _released.set()
        adapter.close()
    stats = adapter.stats()
    assert stats.get("inner_lookup_timeouts", 0) == 0, "no timeout passed"
    assert stats.get("inner_lookup_stopped_closing") == 1
    assert "did not answer a lookup in" not in caplog.text
