"""The installed plugins plus hook implementations a test module defines, discovered once.

A test that registers its own components (a policy with a deliberate bug, a backend that
blocks on an event) does it through hooks, as a plugin would; this builds the plugin set
with them once per name and hands the same one to every later caller.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from lmcache_tiers.plugins import PluginSet, discover

__all__ = ["plugins_with"]

_found: dict[str, PluginSet] = {}


def plugins_with(name: str, **hooks: Callable[..., Any]) -> PluginSet:
    """The installed plugins plus a plugin called ``name`` whose hook implementations are
    ``hooks`` (``tiers_register_store_policies=...``); built on the first call per name."""
    found = _found.get(name)
    if found is None:
        module = types.ModuleType(name.replace("-", "_"))
        for hook, implementation in hooks.items():
            setattr(module, hook, implementation)
        found = _found[name] = discover(extra_plugins={name: module})
    return found
