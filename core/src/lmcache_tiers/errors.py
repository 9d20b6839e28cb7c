"""Exception types shared by every part of lmcache-tiers.

Each carries a message an operator can act on; the CLI prints it as one line.
"""

from __future__ import annotations


class TiersError(Exception):
    """Base class of every error lmcache-tiers raises on purpose."""


class ConfigError(TiersError):
    """Configuration is invalid (bad JSON, unknown name, wrong type, out of range)."""


class PluginError(TiersError):
    """A plugin failed to load or registered something invalid or conflicting."""


class ComponentLoadError(PluginError):
    """A component's implementation could not be imported (e.g. a missing dependency)."""


class BackendUnavailableError(TiersError):
    """A configured backend cannot run on this machine (missing library or device)."""


class KeyValidationError(TiersError, ValueError):
    """An ObjectKey field is unsafe or out of bounds."""


class L1OutOfMemoryError(TiersError):
    """L1 cannot hold a whole batch right now; nothing of the batch was reserved."""
