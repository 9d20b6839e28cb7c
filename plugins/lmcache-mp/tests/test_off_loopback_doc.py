"""What an LMCache operator needs to listen beyond loopback.

LMCache's server takes ``--host 0.0.0.0`` and ``--http-host 0.0.0.0`` as they are.  Here the
native front end needs ``--auth-token`` off loopback, but the ``lmcache_mp`` front end
cannot check one (LMCache's protocol carries no credentials): it needs ``"allow_remote":
true`` and serves whoever reaches it, token or not.  The HTTP endpoint, named by LMCache's
``--http-host``, needs the token off loopback, since ``/status`` is served only against it.
docs/lmcache-compat.md says so in the rows of those two flags and where it lists
``--auth-token`` among the flags lmcache-tiers adds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmcache_tiers.config import ServerConfig, build_config
from lmcache_tiers.errors import ConfigError, SettingRefused
from lmcache_tiers.frontend import check_frontends
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.server.app import check_metrics_host

COMPAT = Path(__file__).resolve().parents[3] / "docs" / "lmcache-compat.md"


def _config(frontend: dict[str, object], **server: object) -> ServerConfig:
    return build_config(load_registry(), overrides=server, frontend_json=[json.dumps(frontend)])


def _row(flag: str) -> str:
    rows: list[str] = re.findall(rf"^\| `{flag}` \|.*$", COMPAT.read_text(), flags=re.MULTILINE)
    (row,) = rows
    return row


def test_the_lmcache_front_end_off_loopback_needs_allow_remote_and_no_token() -> None:
    remote = {"type": "lmcache_mp", "host": "0.0.0.0", "allow_remote": True}
    check_frontends(_config(remote, metrics_port=0), None)
    with pytest.raises(ConfigError, match='"allow_remote": true'):
        check_frontends(_config({"type": "lmcache_mp", "host": "0.0.0.0"}, metrics_port=0), "a-token")
    with pytest.raises(ConfigError, match="requires --auth-token"):
        check_frontends(_config({"type": "native", "host": "0.0.0.0"}, metrics_port=0), None)


def test_the_http_endpoint_off_loopback_needs_the_token() -> None:
    config = _config({"type": "lmcache_mp"}, metrics_host="0.0.0.0", metrics_port=9090)
    with pytest.raises(SettingRefused, match="requires --auth-token"):
        check_metrics_host(config, None)
    check_metrics_host(config, "a-token")


def test_the_compat_table_says_what_each_listener_needs_off_loopback() -> None:
    host = _row("--host")
    assert "`--auth-token`" in host and "native front end" in host
    assert '`"allow_remote": true`' in host and "no token" in host
    assert "`--auth-token`" in _row("--http-host")


def test_the_list_of_added_flags_says_who_needs_the_token() -> None:
    text = " ".join(COMPAT.read_text().split())
    (added,) = re.findall(r"Flags lmcache-tiers adds: .*?;", text)
    assert "`--auth-token` (required off loopback by the native front end and the HTTP endpoint" in added
    assert "the `lmcache_mp` front end checks none" in text
