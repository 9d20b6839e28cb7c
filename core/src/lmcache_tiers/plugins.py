"""Plugin discovery: entry points -> pluggy PluginManager -> component registry.

Entry points in group ``lmcache_tiers`` are scanned once per process with stevedore
(which caches the scan and reports load failures per plugin).  Each loaded module is
registered with pluggy, which validates its hook implementations against the specs.
Registration hooks are then called plugin by plugin, so a plugin that raises is reported
as an error of its own and never stops the others.  A name two distributions register is
contested: both are listed with the conflict, and a configuration using the name is
refused (neither is used), while their other components stay usable.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, ModuleType
from typing import Any, cast

import pluggy

from lmcache_tiers import hookspecs
from lmcache_tiers.errors import ConfigError, PluginError, raised_by_a_plugin
from lmcache_tiers.registry import CONTEST_WAY_OUT, ComponentRegistry, Kind, contest_text

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmcache_tiers"
DISABLE_ENV = "LMCACHE_TIERS_DISABLE_PLUGINS"

#: registration hook -> the component kind it adds
REGISTRATION_HOOKS: dict[str, Kind] = {
    "tiers_register_l2_adapters": Kind.L2_ADAPTER,
    "tiers_register_store_policies": Kind.STORE_POLICY,
    "tiers_register_prefetch_policies": Kind.PREFETCH_POLICY,
    "tiers_register_eviction_policies": Kind.EVICTION_POLICY,
    "tiers_register_serdes": Kind.SERDE,
    "tiers_register_frontends": Kind.FRONTEND,
}


@dataclass
class PluginInfo:
    """What ``plugins list`` shows for one entry point."""

    name: str
    distribution: str
    version: str
    module: str
    error: str | None = None
    disabled: bool = False
    components: list[str] = field(default_factory=list)
    #: the error only left its commands out: its components registered and are usable
    commands_only: bool = False
    #: each name it registered that another distribution registered too (not usable)
    conflicts: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.disabled:
            return f"disabled by {DISABLE_ENV}"
        if self.error:
            return f"error: {self.error}"
        if self.conflicts:
            return f"conflict: {'; '.join(self.conflicts)}; {CONTEST_WAY_OUT}"
        return "ok"


@dataclass
class PluginSet:
    """Result of discovery: the pluggy manager, the registry and a report per plugin."""

    manager: pluggy.PluginManager
    registry: ComponentRegistry
    plugins: list[PluginInfo]

    @property
    def errors(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    @property
    def conflicted(self) -> list[PluginInfo]:
        """The plugins that registered a name another distribution registered too."""
        return [p for p in self.plugins if p.conflicts and not p.error]

    def contest_lines(self) -> list[str]:
        """One line per contested name, naming every distribution registering it."""
        return [f"{contest_text(claimants)}; {CONTEST_WAY_OUT}" for claimants in self.registry.contested()]

    @property
    def unusable(self) -> list[PluginInfo]:
        """The plugins whose components are missing (not those that lost only commands)."""
        return [p for p in self.plugins if p.error and not p.commands_only]


def disabled_names() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {part.strip().lower() for part in raw.split(",") if part.strip()}


def refuse_unknown_disabled(disabled: set[str], installed: list[PluginInfo]) -> None:
    """ConfigError when ``disabled`` holds a name that is neither the entry-point nor the
    distribution name of an installed plugin: a typo would leave the plugin the operator
    meant to keep out enabled, without a word."""
    known = {name.lower() for info in installed for name in (info.name, info.distribution)}
    unknown = sorted(disabled - known)
    if not unknown:
        return
    names = sorted({info.name for info in installed})
    named = ", ".join(repr(name) for name in unknown)
    close = difflib.get_close_matches(unknown[0], [name.lower() for name in names], n=1, cutoff=0.5)
    suggestion = f" (did you mean {close[0]!r}?)" if len(unknown) == 1 and close else ""
    raise ConfigError(
        f"{DISABLE_ENV} names {named}, which no installed plugin is called{suggestion}; "
        f"installed plugins: {', '.join(names) or 'none'}"
    )


def new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    return manager


def _entry_point_infos() -> list[tuple[Any, PluginInfo]]:
    """Scan the entry-point group (cheap: nothing is imported here)."""
    from importlib.metadata import entry_points

    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        # A METADATA without Name or Version (a broken install) reads as None: "?" like an
        # entry point with no distribution at all, so that one plugin cannot stop every command.
        info = PluginInfo(
            name=ep.name,
            distribution=(dist.metadata["Name"] if dist is not None else None) or "?",
            version=(dist.version if dist is not None else None) or "?",
            module=ep.value,
        )
        found.append((ep, info))
    return found


def plugins_own_failure(exc: BaseException, stop_handlers: frozenset[CodeType]) -> bool:
    """Whether ``exc`` raised by a plugin's import, hook, factory or ``open`` is the
    plugin's failure rather than one to go on up: anything but a KeyboardInterrupt where a
    Ctrl-C could raise it (the main thread), or what a stop signal's handler raised where
    it landed (``stop_handlers``: see :func:`signal_handler_codes`).  A ``sys.exit()``, a
    GeneratorExit or a BaseException of the plugin's own must not end the command (with
    it the listing of every other plugin) nor a server's start-up without a word."""
    if isinstance(exc, Exception):
        return True
    if _raised_by_a_signal_handler(exc, stop_handlers | signal_handler_codes()):
        return False
    return not isinstance(exc, KeyboardInterrupt) or raised_by_a_plugin(exc)


def _raised_by_a_signal_handler(exc: BaseException, handlers: frozenset[CodeType]) -> bool:
    """Whether ``exc`` was raised by a signal handler that ran inside the plugin's code: a
    stop signal handled by raising (SIGTERM's SystemExit under a replay, the server's
    start-up interrupted) that landed during discovery.  Taken for the plugin's failure,
    the plugin would be listed as broken and the stop lost.  Told exactly, by a frame in
    the traceback running the code of a handler installed (``handlers``): never by what
    a frame holds, which a plugin's own ``sys.exit()`` beside its caller's frame and a
    small status would pass for a handler's arguments.  A handler with no code of its
    own (``functools.partial(sys.exit, 143)``) leaves no frame to tell it by: its exit is
    taken for the plugin's failure."""
    if threading.current_thread() is not threading.main_thread():
        return False  # handlers run on the main thread only
    traceback = exc.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code in handlers:
            return True
        traceback = traceback.tb_next
    return False


def signal_handler_codes() -> frozenset[CodeType]:
    """The code of every signal handler written in Python installed now.  Taken before a
    plugin's code runs as well as after it raised: a handler may put another in its place
    before it raises (``signals_unwind``'s ignores the next signals)."""
    codes = set()
    for number in signal.Signals:
        code = _code_of(signal.getsignal(number))
        if code is not None:
            codes.add(code)
    return frozenset(codes)


def _code_of(handler: object) -> CodeType | None:
    """The code a handler runs: a function's, a bound method's, a partial's function's or a
    callable object's ``__call__``; None for SIG_DFL, SIG_IGN or one set from C."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    function = getattr(handler, "__func__", handler)
    code = getattr(function, "__code__", None)
    if code is None and callable(handler):
        code = getattr(type(handler).__call__, "__code__", None)  # a callable object
    return code if isinstance(code, CodeType) else None


def _load_modules(infos: dict[str, PluginInfo]) -> dict[str, ModuleType]:
    """Import the enabled plugin modules with stevedore, recording failures per plugin."""
    from stevedore import NamedExtensionManager

    def on_failure(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        info = infos.get(entry_point.name)
        if info is not None:
            info.error = load_failure(info, exc)
        log.debug("plugin %s failed to load: %s", entry_point.name, exc)

    # Named loading imports only the enabled entry points: a disabled plugin that would
    # crash on import is never imported at all.  One manager per plugin: stevedore reports
    # an ``Exception`` through the callback but re-raises ``AssertionError`` (and cannot
    # catch ``SystemExit``), which would otherwise abort the loading of every plugin.
    modules: dict[str, ModuleType] = {}
    stop_handlers = signal_handler_codes()
    for name, info in infos.items():
        if info.disabled:
            continue
        try:
            extensions = NamedExtensionManager(
                namespace=ENTRY_POINT_GROUP,
                names=[name],
                invoke_on_load=False,
                on_load_failure_callback=on_failure,
            )
        except BaseException as exc:  # no Exception: stevedore reports those itself
            if not plugins_own_failure(exc, stop_handlers):
                raise
            info.error = f"{type(exc).__name__}: {exc}"
            log.debug("plugin %s failed to load: %s", name, exc)
            continue
        modules.update((ext.name, cast(ModuleType, ext.plugin)) for ext in extensions.extensions)
    return modules


def load_failure(info: PluginInfo, exc: BaseException) -> str:
    """Why ``info``'s entry point did not load, in one line.

    An entry point naming a module or attribute that is not there (a package uninstalled
    but its metadata left, a module renamed, a dependency missing) says which entry point
    of which distribution names what; any other failure is the exception as raised."""
    missing = _missing_target(info.module, exc)
    if missing is None:
        return f"{type(exc).__name__}: {exc}"
    return (
        f"entry point '{info.name} = {info.module}' of distribution {info.distribution!r} "
        f"{info.version}: {missing}"
    )


def _missing_target(value: str, exc: BaseException) -> str | None:
    """What of the entry-point value ``module:attr`` is missing, when ``exc`` says so."""
    module_name, _, attribute = value.partition(":")
    module_name, attribute = module_name.strip(), attribute.strip()
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        if module_name == exc.name or module_name.startswith(exc.name + "."):
            return f"module {module_name!r} is not installed"
        return f"module {module_name!r} imports {exc.name!r}, which is not installed"
    module = sys.modules.get(module_name)
    if isinstance(exc, AttributeError) and module is not None and attribute:
        # Only when the module did import: an AttributeError raised by its own code while
        # importing is a bug of the plugin, reported as it is.
        target: Any = module
        for part in attribute.split("."):
            if not hasattr(target, part):
                return f"module {module_name!r} has no attribute {attribute!r}"
            target = getattr(target, part)
    return None


def _drop_plugins_with_unknown_hooks(manager: pluggy.PluginManager, ordered: list[PluginInfo]) -> None:
    """Unregister each plugin implementing a hook that has no spec (e.g. a typo)."""
    for _ in range(len(ordered) + 1):
        try:
            manager.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            offender = getattr(exc, "plugin", None)
            culprit = next((i for i in ordered if manager.get_plugin(i.name) is offender), None)
            if culprit is None:
                raise PluginError(f"invalid plugin hooks: {exc}") from exc
            culprit.error = f"invalid hooks: {exc}"
            manager.unregister(name=culprit.name)


def _refuse_returned_components(hook_name: str, returned: object) -> None:
    """A registration hook adds through ``registry.add`` and returns None: one returning
    its components (a list, a dict) registers nothing, and its plugin would be listed as
    loaded with no component, the type it meant unknown to serve with nothing saying why."""
    if returned is not None:
        kind = type(returned).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise PluginError(
            f"{hook_name} returned {article} {kind}, which is ignored: "
            "add each component with registry.add(name, factory, config) and return None"
        )


def _run_registration(manager: pluggy.PluginManager, registry: ComponentRegistry, info: PluginInfo) -> None:
    """Call one plugin's registration hooks; on failure undo what it registered."""
    plugin = manager.get_plugin(info.name)
    # Components are owned by distribution, and one distribution may name several entry
    # points: only what this entry point added is undone or listed as its own.
    before = {id(c) for c in registry.all_components()}
    stop_handlers = signal_handler_codes()
    try:
        for hook_name, kind in REGISTRATION_HOOKS.items():
            # The implementations pluggy found, which may be named otherwise (specname=...);
            # the attribute of the hook's name when there is none, as before.
            functions = [
                i.function for i in getattr(manager.hook, hook_name).get_hookimpls() if i.plugin is plugin
            ]
            if not functions and callable(getattr(plugin, hook_name, None)):
                functions = [getattr(plugin, hook_name)]
            for function in functions:
                returned = function(registry=registry.for_plugin(kind, info.distribution))
                _refuse_returned_components(hook_name, returned)
    # A plugin bug must not take the others down, nor a sys.exit() in it the whole process.
    except BaseException as exc:
        if not plugins_own_failure(exc, stop_handlers):
            raise
        registry.remove_plugin(info.distribution, keep=before)
        info.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, PluginError) else str(exc)
        manager.unregister(name=info.name)
        return
    info.components = [c.qualified_name for c in registry.all_components() if id(c) not in before]


def discover(extra_plugins: dict[str, ModuleType] | None = None) -> PluginSet:
    """Build a fresh PluginSet from the installed entry points (plus ``extra_plugins``)."""
    manager = new_manager()
    registry = ComponentRegistry()
    disabled = disabled_names()
    pairs = _entry_point_infos()
    refuse_unknown_disabled(disabled, [info for _, info in pairs])
    infos: dict[str, PluginInfo] = {}
    # Two distributions using one entry-point name cannot be told apart when loading:
    # both are refused and listed, rather than one of them silently shadowing the other.
    clashing: list[PluginInfo] = []
    for _, info in pairs:
        info.disabled = info.name.lower() in disabled or info.distribution.lower() in disabled
        first = infos.setdefault(info.name, info)
        if first is not info:
            clashing.append(info)
            for each in (first, info):
                each.error = (
                    f"entry point {info.name!r} is provided by both {first.distribution!r} "
                    f"and {info.distribution!r}; uninstall one of them"
                )
    modules = _load_modules({name: info for name, info in infos.items() if not info.error})
    for name, module in (extra_plugins or {}).items():
        infos[name] = PluginInfo(name, name, "", module.__name__)
        modules[name] = module

    ordered = sorted([*infos.values(), *clashing], key=lambda info: info.name)
    for info in ordered:
        loaded = modules.get(info.name)
        if loaded is None and not info.disabled and not info.error:
            # Listed by the metadata but not loaded (a stale entry-point scan): never "ok".
            info.error = "its entry point was not loaded; restart the process"
        if loaded is None or info.disabled or info.error:
            continue
        try:
            manager.register(loaded, name=info.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            info.error = f"invalid hooks: {exc}"
            continue
    _drop_plugins_with_unknown_hooks(manager, ordered)
    for info in ordered:
        if manager.get_plugin(info.name) is not None and not info.error:
            _run_registration(manager, registry, info)
    registry.failed_plugins = {info.name: info.error for info in ordered if info.error}
    _note_conflicts(registry, ordered)
    return PluginSet(manager, registry, ordered)


def _note_conflicts(registry: ComponentRegistry, ordered: list[PluginInfo]) -> None:
    """List, on each plugin that registered a contested name, that name and the others
    registering it (``plugins list`` shows it as the plugin's status)."""
    for claimants in registry.contested():
        for claimant in claimants:
            others = " and ".join(repr(c.plugin) for c in claimants if c is not claimant)
            for info in ordered:
                if info.distribution == claimant.plugin and claimant.qualified_name in info.components:
                    info.conflicts.append(f"{claimant.qualified_name} is also registered by {others}")


def call_each(
    hook: Any,
    on_error: Callable[[str, Exception], None],
    before_each: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> None:
    """Call every implementation of ``hook`` (a pluggy hook caller), in pluggy's order, each
    on its own: pluggy's own call stops at the first that raises, so one plugin's bug would
    keep every later plugin's implementation from running (a stopping hook that flushes,
    say).  A failure goes to ``on_error(plugin_name, exception)``, a ``sys.exit()`` as a
    PluginError saying so; ``before_each(plugin_name)`` runs before each call
    (to note what a failing one must undo)."""
    stop_handlers = signal_handler_codes()
    for impl in reversed(hook.get_hookimpls()):
        try:
            if before_each is not None:
                before_each(impl.plugin_name)
            if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
                raise PluginError(f"{hook.name} takes no hook wrappers")
            impl.function(*[kwargs[name] for name in impl.argnames])
        except Exception as exc:
            on_error(impl.plugin_name, exc)
        except BaseException as exc:  # as in registration: a plugin's sys.exit() is its failure
            if not plugins_own_failure(exc, stop_handlers):
                raise
            failure = PluginError(f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc  # its traceback: where in the plugin it exited
            on_error(impl.plugin_name, failure)


_cache: PluginSet | None = None
_cache_lock = threading.Lock()


def load_plugins() -> PluginSet:
    """The process-wide PluginSet, discovered on first use."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = discover()
        return _cache


def load_registry() -> ComponentRegistry:
    return load_plugins().registry


def reset_cache() -> None:
    """Forget the discovery result (tests that install plugins at run time)."""
    global _cache
    with _cache_lock:
        _cache = None
