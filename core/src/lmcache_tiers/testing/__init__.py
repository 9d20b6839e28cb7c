"""Conformance kit: test suites every plugin of a kind subclasses.

A plugin's tests subclass the suite for its kind (``L2AdapterSuite``,
``StorePolicySuite``, ``EvictionPolicySuite``, ``SerdeSuite``, ``FrontendSuite`` in
:mod:`lmcache_tiers.testing.frontend` ...) and provide the fixture the suite names; capabilities that do not apply are declared on the subclass and their tests are
skipped with the reason printed, never faked.  ``ComponentSuite`` is the base of them
all: it checks that the component is discoverable through its installed entry point.
"""

from lmcache_tiers.testing.base import ComponentSuite, capability, requires
from lmcache_tiers.testing.serde import BINDS_KEY, DETECTS_CORRUPTION, LOSSLESS, SerdeSuite

__all__ = [
    "BINDS_KEY",
    "DETECTS_CORRUPTION",
    "LOSSLESS",
    "ComponentSuite",
    "SerdeSuite",
    "capability",
    "requires",
]
