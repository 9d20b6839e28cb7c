"""Hook specifications of lmcache-tiers: the only contract between core and plugins.

Every plugin module named by an entry point in the ``lmcache_tiers`` group may implement
any of these hooks with ``@hookimpl``.  Registration hooks receive a kind-specific
:class:`~lmcache_tiers.registry.KindRegistry` to add components to; they must stay cheap
(no heavy imports) because they run whenever plugins are listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from lmcache_tiers.registry import KindRegistry

PROJECT_NAME = "lmcache_tiers"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    """Add L2 adapter types.

    Runs once per process, when the component registry is first built.  Call
    ``registry.add(name, factory, config, doc)`` once per adapter type; ``factory`` is a
    callable or a ``"module:attr"`` string imported only when the adapter is configured.
    The factory is called as ``factory(config, context)`` with the decoded config Struct
    and a :class:`~lmcache_tiers.l2.BackendContext`, and returns an L2 backend (see
    :class:`~lmcache_tiers.protocols.L2Backend`; core wraps it in the adapter the
    controllers use) or, for advanced uses, a complete L2 adapter.  Return None: a hook
    returning a value (its components, say) is refused as that plugin's error, since
    nothing it returns is registered.
    """


@hookspec
def tiers_register_store_policies(registry: KindRegistry) -> None:
    """Add store policies (which adapters a freshly written L1 object goes to).

    Runs once per process when the registry is built.  The factory is called as
    ``factory(config)`` and returns a :class:`~lmcache_tiers.policies.StorePolicy`.
    Return None: a hook returning a value (its components, say) is
    refused as that plugin's error, since nothing it returns is registered.
    """


@hookspec
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    """Add prefetch policies (which adapter each L2 hit is loaded from).

    Runs once per process when the registry is built.  The factory is called as
    ``factory(config)`` and returns a :class:`~lmcache_tiers.policies.PrefetchPolicy`.
    Return None: a hook returning a value (its components, say) is
    refused as that plugin's error, since nothing it returns is registered.
    """


@hookspec
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    """Add eviction policies, used for L1 and for per-adapter L2 eviction.

    Runs once per process when the registry is built.  The factory is called as
    ``factory(config)`` and returns a :class:`~lmcache_tiers.policies.EvictionPolicy`.
    Return None: a hook returning a value (its components, say) is
    refused as that plugin's error, since nothing it returns is registered.
    """


@hookspec
def tiers_register_serdes(registry: KindRegistry) -> None:
    """Add serde transforms applied to bytes on their way into and out of L2.

    Runs once per process when the registry is built.  The factory is called as
    ``factory(config)`` and returns a :class:`~lmcache_tiers.serde.Serde`.
    Return None: a hook returning a value (its components, say) is
    refused as that plugin's error, since nothing it returns is registered.
    """


@hookspec
def tiers_register_frontends(registry: KindRegistry) -> None:
    """Add front ends: wire protocols the server speaks (the native one is registered
    this way too, by ``lmcache-plugin-frontend-native``).

    Runs once per process when the registry is built.  The config Struct subclasses
    :class:`~lmcache_tiers.frontend.FrontendConfig` (``host``, ``port`` and a ``check``
    run before L1 exists).  The factory is called as ``factory(config, context)`` with a
    :class:`~lmcache_tiers.frontend.FrontendContext` (the running StorageManager, the
    resolved address ...); it binds its sockets and returns a
    :class:`~lmcache_tiers.frontend.Frontend`.  Return None: a hook returning a value (its components, say) is
    refused as that plugin's error, since nothing it returns is registered.
    """


@hookspec
def tiers_register_commands(app: typer.Typer) -> None:
    """Add sub-commands to the ``lmcache-tiers`` CLI.

    Runs once when the CLI is built, before arguments are parsed.  Call
    ``app.command()(fn)`` or ``app.add_typer(sub_app, name=...)``; keep imports inside
    the command functions so ``--help`` stays fast.  Return value is ignored.  An
    implementation that raises loses its commands, not the CLI: one warning line names
    the plugin, which ``plugins list`` shows with the error.
    """


@hookspec
def tiers_server_started(config: Any, storage: Any) -> None:
    """Called once after ``lmcache-tiers serve`` is listening.

    Receives the resolved :class:`~lmcache_tiers.config.ServerConfig` and the running
    StorageManager.  Must not block; start your own thread for long work.
    """


@hookspec
def tiers_server_stopping(config: Any, storage: Any) -> None:
    """Called once when the server begins a graceful shutdown, before storage closes.

    Must return promptly: the shutdown deadline keeps running while it executes.
    """
