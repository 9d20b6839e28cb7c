"""Building an adapter from its spec: the one path the StorageManager, wrappers and the
conformance suite take.

A factory registered for kind ``l2_adapter`` is called as ``factory(config, context)``
with a :class:`~lmcache_tiers.l2.context.BackendContext` and returns a backend, which core
wraps in :class:`~lmcache_tiers.l2.adapter.BackendAdapter` (behind a circuit breaker when
its config or its being remote asks for one, :mod:`~lmcache_tiers.l2.circuit`).  A factory may instead return
a complete :class:`~lmcache_tiers.l2.interface.L2Adapter` (advanced, tests), used as is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lmcache_tiers.config import AdapterSpec, FieldError, L2AdapterConfig, decode_adapter_at
from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l2.adapter import BackendAdapter
from lmcache_tiers.l2.calls import missing_methods
from lmcache_tiers.l2.circuit import guard_backend
from lmcache_tiers.l2.context import AdapterContext, BackendContext
from lmcache_tiers.l2.interface import L2Adapter
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.registry import Kind, call_factory, call_plugin
from lmcache_tiers.serde import build_serde_chain
from lmcache_tiers.start_failures import named_start_failure

if TYPE_CHECKING:
    from lmcache_tiers.registry import ComponentRegistry

log = logging.getLogger("lmcache_tiers.l2")

__all__ = ["build_adapter", "create_adapter", "open_inner_backend"]


def _discard(made: object) -> None:
    close = getattr(made, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            log.exception("closing a refused %s failed", type(made).__name__)


def _made(factory: Callable[..., Any], config: L2AdapterConfig, context: BackendContext, what: str) -> Any:
    """What a factory built, if it is an L2 backend or a complete L2Adapter."""
    made = call_factory(factory, what, config, context)
    if isinstance(made, L2Adapter) or not missing_methods(made):
        return made
    _discard(made)
    missing = ", ".join(missing_methods(made))
    raise ConfigError(
        f"{what} built {type(made).__name__}, which is neither an L2 backend (it lacks {missing}) "
        "nor an L2Adapter"
    )


def create_adapter(
    factory: Callable[..., Any],
    config: L2AdapterConfig,
    facts: AdapterContext,
    *,
    registry: ComponentRegistry | None = None,
    type_name: str = "",
    plugin: str = "",
) -> L2Adapter:
    """Call an adapter factory and wrap what it returns (unless it is an adapter already)."""
    context = BackendContext(AdapterState(facts, registry))
    what = _adapter_named(facts, type_name, plugin)
    made = _made(factory, config, context, what)
    if isinstance(made, L2Adapter):
        return made
    return _opened(made, config, context, what)


def _opened(made: object, config: L2AdapterConfig, context: BackendContext, what: str) -> L2Adapter:
    """The adapter of backend ``made``, its plain ``open`` run (by BackendAdapter)."""
    # Any Exception of the plugin's open is raised as it is (the adapter names it); a
    # sys.exit() in it would end serve with its status alone.
    adapter: L2Adapter = call_plugin(
        lambda: BackendAdapter(guard_backend(made, config, context), context), what, "open", (Exception,)
    )
    return adapter


def _adapter_named(facts: AdapterContext, type_name: str, plugin: str) -> str:
    """``1:redis: l2 adapter 'redis' from plugin 'lmcache-plugin-redis'``: first the name
    the adapter has in logs and metrics (which of several, of one type maybe), as its own
    refusals begin, then its type and whose it is."""
    of_plugin = f" from plugin {plugin!r}" if plugin else ""
    if not type_name:
        return f"l2 adapter {facts.name!r}{of_plugin}"
    return f"{facts.name}: l2 adapter {type_name!r}{of_plugin}"


def build_adapter(registry: ComponentRegistry, spec: AdapterSpec, facts: AdapterContext) -> L2Adapter:
    """The adapter a resolved spec describes (its serde chain is in ``facts.serde``).

    What building or opening it raises names the adapter, so that with several adapters
    configured the one that failed is known: a FieldError becomes a ConfigError naming
    the value's path, any other exception but core's own errors a PluginError (the
    original chained: the open-files check of start-up looks down the chain)."""
    component = registry.get(Kind.L2_ADAPTER, spec.type)
    factory = component.load()
    try:
        return create_adapter(
            factory, spec.config, facts, registry=registry, type_name=spec.type, plugin=component.plugin
        )
    except TiersError:
        raise  # core's refusals, and a plugin's own, name what they refuse
    except Exception as exc:  # an OSError or ValueError of its constructor, what a plain open raised
        what = _adapter_named(facts, spec.type, component.plugin)
        raise named_start_failure(exc, what, f"$.l2_adapters[{facts.index}]") from exc


def open_inner_backend(state: AdapterState, outer: str, raw: Mapping[str, Any], counter_prefix: str) -> Any:
    """The backend a wrapper wraps, built from its spec inside the wrapper's adapter."""
    if state.registry is None:
        from lmcache_tiers.plugins import load_registry

        state.registry = load_registry()
    registry = state.registry
    # A config decoded by build_config had its inner specs checked already; this is for
    # adapters built directly (tests, the conformance suite).  Each wrapper level adds one
    # ">" to the name (below) and one ".inner" to the path.
    where = f"$.l2_adapters[{state.facts.index}]" + ".inner" * (outer.count(">") + 1)
    try:
        spec = decode_adapter_at(registry, dict(raw), where)
    except ConfigError as exc:
        raise ConfigError(f"{outer} `inner`: {exc}") from exc
    if spec.config.eviction is not None:
        log.warning("%s: eviction of the inner adapter never runs; set it on %s", outer, outer)
    state.chain.extend(build_serde_chain(spec.serde, registry))
    name = f"{outer}>{spec.type}"
    context = BackendContext(state, name=name, config=spec.config, counter_prefix=counter_prefix)
    component = registry.get(Kind.L2_ADAPTER, spec.type)
    what = f"{outer} `inner` {spec.type!r} from plugin {component.plugin!r}"
    try:
        made = _made(component.load(), spec.config, context, what)
    except FieldError as exc:
        # the path of the inner spec's value: the outer adapter's would name another
        raise named_start_failure(exc, what, where) from exc
    if isinstance(made, L2Adapter):
        _discard(made)
        raise ConfigError(f"{outer} wraps L2 backends; {spec.type!r} builds a complete adapter")
    return made
