"""The one line of a configured component that fails to start.

``call_factory`` hands a factory's ``OSError`` and ``ValueError`` back as they are, for
callers that know what they mean (a front end's port taken).  Raised by a policy, a serde
or an adapter they are the plugin's own failure, and serve's line must say whose it was:
with several components of several plugins configured, ``[Errno 5] disk gone`` alone
names none of them.  A ``FieldError`` is the plugin refusing a value of its config, so
it is a config error (exit 2) naming the value; anything else a ``PluginError`` (exit 1).
"""

from __future__ import annotations

from typing import Any

from lmcache_tiers.config import FieldError
from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.registry import Component, plugin_failed

__all__ = ["create_component", "named_start_failure"]


def named_start_failure(exc: Exception, what: str, path: str = "") -> TiersError:
    """The error to raise, ``from exc``, for ``what`` failing to start with ``exc``, an
    exception of its plugin's code; ``path`` is where its config sits (``$.l2_adapters[0]``)
    for a FieldError to name the value, empty when no configuration names it."""
    if isinstance(exc, FieldError):
        where = f" - at `{path}.{exc.field}`" if path else f" (field {exc.field!r})"
        return ConfigError(f"{what}: {exc}{where}")
    return plugin_failed(what, "start", exc)


def create_component(
    component: Component,
    *args: Any,
    what: str = "",
    path: str = "",
    kept: tuple[type[Exception], ...] = (),
) -> Any:
    """``component.create(*args)``, what its factory raises named as ``what`` (by default
    the component and its plugin; core's own errors, and ``kept``, as they are)."""
    try:
        return component.create(*args)
    except TiersError:
        raise  # core's refusals, and a plugin's own, name what they refuse
    except kept:
        raise
    except (OSError, ValueError) as exc:
        raise named_start_failure(exc, what or component.origin, path) from exc
