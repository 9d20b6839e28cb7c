"""Component registry: (kind, name) -> factory, config Struct and documentation.

Plugins add components through the registration hooks; core resolves names from the
configuration here.  Factories may be ``"module:attr"`` strings so that listing plugins
never imports an implementation (NIXL, torch, s3fs ...).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import msgspec

from lmcache_tiers.errors import ComponentLoadError, ConfigError, PluginError, TiersError


class Kind(str, Enum):
    """The kinds of component a plugin can provide."""

    L2_ADAPTER = "l2_adapter"
    STORE_POLICY = "store_policy"
    PREFETCH_POLICY = "prefetch_policy"
    EVICTION_POLICY = "eviction_policy"
    SERDE = "serde"
    FRONTEND = "frontend"


class EmptyConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Config of a component that takes no options.

    (Not a ``ComponentConfig``: the registry cannot import config, which imports it.)
    """


@dataclass
class Component:
    """One registered component and where it came from."""

    kind: Kind
    name: str
    factory: Callable[..., Any] | str
    config: type[msgspec.Struct]
    doc: str
    plugin: str
    install_hint: str = ""
    _loaded: Callable[..., Any] | None = field(default=None, repr=False)

    @property
    def qualified_name(self) -> str:
        return f"{self.kind.value}:{self.name}"

    @property
    def origin(self) -> str:
        """``eviction_policy:lru from plugin 'lmcache-plugin-eviction-lru'``: how errors name it."""
        return f"{self.qualified_name} from plugin {self.plugin!r}"

    def load(self) -> Callable[..., Any]:
        """Import the factory on first use; a missing dependency becomes a clear error."""
        if self._loaded is not None:
            return self._loaded
        if callable(self.factory):
            self._loaded = self.factory
            return self._loaded
        module_name, _, attr = self.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except ImportError as exc:
            hint = f" ({self.install_hint})" if self.install_hint else ""
            raise ComponentLoadError(
                f"{self.qualified_name} from plugin {self.plugin!r} cannot be loaded: {exc}{hint}"
            ) from exc
        except AttributeError as exc:
            raise ComponentLoadError(
                f"{self.qualified_name} from plugin {self.plugin!r} points at "
                f"{self.factory!r}, which does not exist: {exc}"
            ) from exc
        except (Exception, SystemExit) as exc:
            # A module that fails while importing (no GPU, a syntax error, an empty module
            # name, a sys.exit()) is the plugin's fault: one line naming it, not a traceback
            # nor a silent exit.
            raise ComponentLoadError(
                f"{self.qualified_name} from plugin {self.plugin!r} failed to import "
                f"{self.factory!r}: {type(exc).__name__}: {exc}"
            ) from exc
        self._loaded = cast(Callable[..., Any], obj)
        return self._loaded

    def create(self, *args: Any) -> Any:
        factory = self.load()
        return call_factory(factory, self.origin, *args)


#: what a factory may raise as it is: core's own errors, an address or path the
#: environment refuses (callers explain it), and a refusal of its config (FieldError)
FACTORY_ERRORS_KEPT = (TiersError, OSError, ValueError)


def call_factory(factory: Callable[..., Any], what: str, *args: Any) -> Any:
    """``factory(*args)``; any other exception it raises (a plugin's bug, a store it cannot
    reach, a ``sys.exit()``) becomes one PluginError line naming ``what`` (the component
    and its plugin), the original chained for the traceback."""
    return call_plugin(lambda: factory(*args), what, "start", FACTORY_ERRORS_KEPT)


def call_plugin(call: Callable[[], Any], what: str, doing: str, kept: tuple[type[BaseException], ...]) -> Any:
    """``call()``, a plugin's code: what it raises is raised as it is when ``kept``, a Ctrl-C
    or what a stop signal's handler raised (those stop start-up); anything else the
    plugin raised itself, a ``sys.exit()`` too, becomes one PluginError line: ``what``
    failed to ``doing``."""
    # plugins imports this module: imported here, when a plugin is called
    from lmcache_tiers.plugins import plugins_own_failure, signal_handler_codes

    stop_handlers = signal_handler_codes()
    try:
        return call()
    except kept:
        raise
    except BaseException as exc:
        if not plugins_own_failure(exc, stop_handlers):
            raise
        raise plugin_failed(what, doing, exc) from exc


def plugin_failed(what: str, doing: str, exc: BaseException) -> PluginError:
    """The one line of a plugin's ``what`` that failed to ``doing`` (start, open) by
    raising ``exc``; raise it ``from exc``, so the traceback keeps the original."""
    return PluginError(f"{what} failed to {doing}: {type(exc).__name__}: {exc}")


def _refuse_undecodable_fields(config: type[msgspec.Struct], where: str) -> None:
    """Refuse a config Struct with a field no configuration value decodes into (a class
    of the plugin's own, a lock, a callable): listed as loaded, every value a user gave
    that field would be refused at serve, and `plugins show` could not list its options.
    msgspec builds a schema exactly for the types it decodes, so that is the test."""
    try:
        msgspec.json.schema(config)
    except (TypeError, ValueError) as whole:
        raise PluginError(f"{where} {config.__name__} {_undecodable_field(config, whole)}") from whole


def _undecodable_field(config: type[msgspec.Struct], whole: Exception) -> str:
    """Which field of ``config`` msgspec has no schema of, and why, in a few words."""
    for each in msgspec.structs.fields(config):
        try:
            msgspec.json.schema(each.type)
        except (TypeError, ValueError) as exc:
            return f"has field {each.name!r} of a type no configuration value decodes into: {_last_line(exc)}"
    # every type alone is fine: a default msgspec cannot encode
    return f"cannot be described: {_last_line(whole)}"


def _last_line(exc: Exception) -> str:
    # msgspec's reason is several lines; its last one names the type at fault
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class ContestedNameError(ConfigError):
    """A configuration names a component that two or more distributions registered."""


#: what ends a contest over a name (``plugins.DISABLE_ENV``: plugins imports this module)
CONTEST_WAY_OUT = "uninstall one of them (or disable one with LMCACHE_TIERS_DISABLE_PLUGINS)"


def contest_text(claimants: Collection[Component]) -> str:
    """``kind 'name' is registered by both 'a' and 'b'; none of them is used``: one contested name."""
    first = next(iter(claimants))
    plugins = [repr(c.plugin) for c in claimants]
    named = ", ".join(plugins[:-1]) + f" and {plugins[-1]}"
    return (
        f"{first.kind.value.replace('_', ' ')} {first.name!r} is registered by "
        f"{'both' if len(plugins) == 2 else 'each of'} {named}; none of them is used"
    )


class KindRegistry:
    """The object a registration hook receives: adds components of one kind."""

    def __init__(self, owner: ComponentRegistry, kind: Kind, plugin: str) -> None:
        self._owner = owner
        self.kind = kind
        self.plugin = plugin

    def add(
        self,
        name: str,
        factory: Callable[..., Any] | str,
        config: type[msgspec.Struct] = EmptyConfig,
        doc: str = "",
        *,
        install_hint: str = "",
    ) -> None:
        """Register component ``name``; ``doc`` defaults to the config's docstring."""
        if not name or not isinstance(name, str):
            raise PluginError(f"plugin {self.plugin!r} registered a {self.kind.value} with no name")
        if not (isinstance(config, type) and issubclass(config, msgspec.Struct)):
            raise PluginError(
                f"plugin {self.plugin!r}: config of {self.kind.value}:{name} must be a msgspec.Struct"
            )
        _refuse_undecodable_fields(config, f"plugin {self.plugin!r}: config of {self.kind.value}:{name}")
        if not isinstance(factory, str) and not callable(factory):
            raise PluginError(
                f"plugin {self.plugin!r}: factory of {self.kind.value}:{name} must be "
                f"a callable or 'module:attr', got {type(factory).__name__}"
            )
        if isinstance(factory, str) and ":" not in factory:
            raise PluginError(
                f"plugin {self.plugin!r}: factory of {self.kind.value}:{name} must be "
                f"a callable or 'module:attr', got {factory!r}"
            )
        if not isinstance(doc, str):
            # Printed by `plugins show`: refused here, as this plugin's error, rather than
            # crashing that command later.
            raise PluginError(
                f"plugin {self.plugin!r}: doc of {self.kind.value}:{name} must be text, "
                f"got {type(doc).__name__}"
            )
        text = doc or (config.__doc__ or "").strip()
        self._owner._add(Component(self.kind, name, factory, config, text, self.plugin, install_hint))


class ComponentRegistry:
    """Every component contributed by the loaded plugins."""

    def __init__(self) -> None:
        self._by_kind: dict[Kind, dict[str, Component]] = {kind: {} for kind in Kind}
        #: (kind, lowered name) -> every component of that name, in registration order,
        #: when distributions disagree on it: resolving the name is refused (see ``get``)
        self._contested: dict[tuple[Kind, str], list[Component]] = {}
        #: plugin name -> why it failed to load: an unknown name may be one of theirs
        self.failed_plugins: dict[str, str] = {}

    def for_plugin(self, kind: Kind, plugin: str) -> KindRegistry:
        return KindRegistry(self, kind, plugin)

    def _add(self, component: Component) -> None:
        key = component.name.lower()
        existing = self._by_kind[component.kind].get(key)
        if existing is None:
            self._by_kind[component.kind][key] = component
            return
        claimants = self._contested.get((component.kind, key), [existing])
        if any(each.plugin == component.plugin for each in claimants):
            raise PluginError(
                f"{component.qualified_name} is registered twice by plugin {component.plugin!r}"
            )
        self._contested[(component.kind, key)] = claimants
        # Neither distribution wins: the one whose entry point sorts first would otherwise
        # take the name silently (a third-party `fs` receiving every write meant for the
        # shipped one).  Both stay listed; a configuration using the name is refused.
        claimants.append(component)

    def contested(self) -> list[list[Component]]:
        """The names two or more distributions registered: every claimant of each."""
        return [list(claimants) for claimants in self._contested.values()]

    def remove_plugin(self, plugin: str, keep: Collection[int] = ()) -> None:
        """Forget everything one plugin registered (used when its hooks fail midway),
        except the components whose ``id`` is in ``keep``; a name it contested goes back
        to the one distribution left claiming it."""

        def gone(component: Component) -> bool:
            return component.plugin == plugin and id(component) not in keep

        for (kind, key), claimants in list(self._contested.items()):
            claimants[:] = [c for c in claimants if not gone(c)]
            if claimants:
                self._by_kind[kind][key] = claimants[0]
            if len(claimants) < 2:
                del self._contested[(kind, key)]
        for components in self._by_kind.values():
            for key in [k for k, c in components.items() if gone(c)]:
                del components[key]

    def all_components(self) -> Iterator[Component]:
        """Every component registered, each claimant of a contested name included."""
        yield from self.components()
        for claimants in self._contested.values():
            yield from claimants[1:]

    def names(self, kind: Kind) -> list[str]:
        return sorted(c.name for c in self._by_kind[kind].values())

    def components(self, kind: Kind | None = None) -> Iterator[Component]:
        kinds = [kind] if kind is not None else list(Kind)
        for each in kinds:
            yield from sorted(self._by_kind[each].values(), key=lambda c: c.name)

    def get(self, kind: Kind, name: str) -> Component:
        """Resolve a configured name (case-insensitive) or raise with suggestions."""
        found = self._by_kind[kind].get(str(name).lower())
        claimants = self._contested.get((kind, str(name).lower()))
        if claimants is not None:
            raise ContestedNameError(f"{contest_text(claimants)}; {CONTEST_WAY_OUT}")
        if found is not None:
            return found
        installed = self.names(kind)
        close = difflib.get_close_matches(str(name), installed, n=1, cutoff=0.5)
        if not close:
            lowered = {n.lower(): n for n in installed}
            match = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.5)
            close = [lowered[m] for m in match]
        suggestion = f"did you mean {close[0]!r}? " if close else ""
        listing = ", ".join(installed) if installed else "none"
        raise ConfigError(
            f"unknown {kind.value.replace('_', ' ')} {name!r}: {suggestion}installed: {listing}"
            f"{self._failed_plugins_note()}"
        )

    def _failed_plugins_note(self) -> str:
        """The plugins that failed to load, for an unknown name: what a broken plugin would
        have registered is not known (it may have failed on import), so each is named."""
        if not self.failed_plugins:
            return ""
        failures = "; ".join(f"{name}: {error}" for name, error in sorted(self.failed_plugins.items()))
        return f"; plugins that failed to load (one may provide it): {failures}"
