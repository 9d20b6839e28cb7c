"""The component suite fails a config field without a description: `plugins show` and the
configuration reference print nothing for it, and the suite let it pass."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any

import msgspec
import pytest

from lmcache_tiers.testing.base import ComponentSuite


class Described(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    size_gb: Annotated[float, msgspec.Meta(description="Capacity in GiB.")] = 1.0


class HalfDescribed(Described, frozen=True, forbid_unknown_fields=True):
    path: str = ""


def suite_of(config: type[msgspec.Struct]) -> ComponentSuite:
    class Probe(ComponentSuite):
        component_name = "probe"

        def registered_component(self) -> Any:
            return SimpleNamespace(config=config)

    return Probe()


def test_a_field_without_a_description_fails_the_suite_by_name() -> None:
    with pytest.raises(AssertionError, match=r"probe: config fields without a description: path \("):
        suite_of(HalfDescribed).test_every_config_field_is_documented()


def test_a_config_whose_fields_are_all_described_passes() -> None:
    suite_of(Described).test_every_config_field_is_documented()
