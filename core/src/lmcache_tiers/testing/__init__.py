"""Conformance kit: test suites every plugin of a kind subclasses.

A plugin's tests subclass the suite for its kind (``L2AdapterSuite``,
``StorePolicySuite``, ``EvictionPolicySuite``, ``SerdeSuite``, ``FrontendSuite`` in
:mod:`lmcache_tiers.testing.frontend` ...) and provide the fixture the suite names;
capabilities that do not apply are declared on the subclass and their tests are skipped
with the reason printed, never faked.  ``ComponentSuite`` is the base of them all: it
checks that the component is discoverable through its installed entry point.

Names are imported on first use: :mod:`lmcache_tiers.testing.blocking` (blocking calls
over an adapter, for tests and tools) works without pytest installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_tiers.testing.base import ComponentSuite, capability, requires
    from lmcache_tiers.testing.blocking import BlockingAdapterClient
    from lmcache_tiers.testing.serde import BINDS_KEY, DETECTS_CORRUPTION, LOSSLESS, SerdeSuite

_EXPORTS = {
    "BlockingAdapterClient": "lmcache_tiers.testing.blocking",
    "ComponentSuite": "lmcache_tiers.testing.base",
    "capability": "lmcache_tiers.testing.base",
    "requires": "lmcache_tiers.testing.base",
    "SerdeSuite": "lmcache_tiers.testing.serde",
    "LOSSLESS": "lmcache_tiers.testing.serde",
    "DETECTS_CORRUPTION": "lmcache_tiers.testing.serde",
    "BINDS_KEY": "lmcache_tiers.testing.serde",
}

__all__ = [
    "BINDS_KEY",
    "DETECTS_CORRUPTION",
    "LOSSLESS",
    "BlockingAdapterClient",
    "ComponentSuite",
    "SerdeSuite",
    "capability",
    "requires",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
