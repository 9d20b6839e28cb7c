"""Base class of the conformance suites and the capability mechanism they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgspec
import pytest

from lmcache_tiers.config_docs import component_fields
from lmcache_tiers.plugins import load_plugins
from lmcache_tiers.registry import Component, ComponentRegistry, Kind

F = TypeVar("F", bound=Callable[..., Any])


def capability(name: str) -> str:
    """Name a capability a suite test depends on (documentation helper)."""
    return name


def requires(*capabilities: str) -> Callable[[F], F]:
    """Mark a suite test as needing capabilities the subclass may not declare.

    A subclass lists what its component supports in ``capabilities``; a test that needs
    something missing is skipped with a reason naming the capability.
    """

    def mark(test: F) -> F:
        test.__tiers_requires__ = frozenset(capabilities)  # type: ignore[attr-defined]
        return test

    return mark


class ComponentSuite:
    """Checks every component must pass; subclasses set ``kind`` and ``component_name``."""

    kind: ClassVar[Kind]
    component_name: ClassVar[str]
    #: capabilities the component under test supports (see ``requires``)
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @pytest.fixture(autouse=True)
    def _skip_unsupported(self, request: pytest.FixtureRequest) -> None:
        needed: frozenset[str] = getattr(request.function, "__tiers_requires__", frozenset())
        missing = sorted(needed - self.capabilities)
        if missing:
            pytest.skip(f"{self.component_name} does not declare capability: {', '.join(missing)}")

    def registry(self) -> ComponentRegistry:
        """The registry of the installed plugins the suite builds components from."""
        return load_plugins().registry

    def registered_component(self) -> Component:
        return self.registry().get(self.kind, self.component_name)

    def test_discoverable_through_entry_point(self) -> None:
        plugin_set = load_plugins()
        component = self.registered_component()
        owners = [p for p in plugin_set.plugins if component.qualified_name in p.components]
        assert owners, f"{component.qualified_name} is not registered by any installed plugin"
        assert all(p.status == "ok" for p in owners)

    def test_config_is_a_frozen_strict_struct(self) -> None:
        config = self.registered_component().config
        assert issubclass(config, msgspec.Struct)
        assert config.__struct_config__.frozen
        assert config.__struct_config__.forbid_unknown_fields

    def test_every_config_field_is_documented(self) -> None:
        # `plugins show` and the generated configuration reference print these descriptions:
        # a field without one leaves operators guessing what it does
        config = self.registered_component().config
        undocumented = [field.name for field in component_fields(config) if not field.doc.strip()]
        assert not undocumented, (
            f"{self.component_name}: config fields without a description: {', '.join(undocumented)}"
            " (give each Annotated[<type>, msgspec.Meta(description=...)])"
        )

    def test_factory_loads(self) -> None:
        assert callable(self.registered_component().load())
