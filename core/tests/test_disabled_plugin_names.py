"""``LMCACHE_TIERS_DISABLE_PLUGINS`` names plugins to keep out.  A name matching no
installed plugin (a typo) would leave the plugin the operator meant enabled without a
word: discovery refuses it as a configuration mistake naming the name and the installed
plugins."""

from __future__ import annotations

import pytest

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import DISABLE_ENV, discover


def test_a_name_no_installed_plugin_has_is_refused_naming_the_installed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DISABLE_ENV, "mock, redsi")
    with pytest.raises(ConfigError) as refused:
        discover()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{DISABLE_ENV} names 'redsi', which no installed plugin is called")
    assert "did you mean 'redis'?" in message
    assert "installed plugins: " in message and "redis" in message and "fs" in message


def test_plugins_named_by_entry_point_or_distribution_are_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, " Mock ,lmcache-plugin-redis,")
    plugins = {info.name: info for info in discover().plugins}
    assert plugins["mock"].disabled and plugins["redis"].disabled
    assert not plugins["fs"].disabled
