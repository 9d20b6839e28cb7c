"""``plugins new`` refuses a name with the whole rule it broke, a leading digit included."""

from __future__ import annotations

import pytest

from lmcache_tiers.cli.plugins_new import SkeletonKind, plugin_values
from lmcache_tiers.errors import ConfigError


@pytest.mark.parametrize("name", ["1abc", "9-store", "my-2nd-store!"])
def test_a_refused_name_is_told_the_rule_it_broke(name: str) -> None:
    with pytest.raises(ConfigError, match="starting with a letter"):
        plugin_values(name, SkeletonKind.L2)


def test_a_name_with_digits_after_its_first_letter_is_taken() -> None:
    assert plugin_values("s3-store2", SkeletonKind.L2)["component"] == "s3_store2"
