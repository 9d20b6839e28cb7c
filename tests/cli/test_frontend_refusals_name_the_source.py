"""A front-end refusal names the setting as the user gave it: ``--metrics-port`` only when
that flag set the port, the ``metrics_port`` key when the --config file did."""

from __future__ import annotations

import uuid
from pathlib import Path

from thirdparty import run_cli

from lmcache_tiers.config import FrontendConfig, FrontendSpec, ServerConfig
from lmcache_tiers.errors import SettingRefused
from lmcache_tiers.testing.ports import free_port

NARROW = {"COLUMNS": "40"}


def _refusal(args: list[str]) -> str:
    shm = f"tiers_refusal_{uuid.uuid4().hex[:10]}"
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--shm-name", shm, *args], **NARROW)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _native_on(tmp_path: Path, port: int, extra: str = "") -> Path:
    config = tmp_path / "server.toml"
    config.write_text(f'{extra}[[frontends]]\ntype = "native"\nport = {port}\n')
    return config


def test_an_http_port_in_the_config_file_taken_by_a_front_end_is_named_by_its_key(tmp_path: Path) -> None:
    port = free_port()
    config = _native_on(tmp_path, port, f"metrics_port = {port}\n")
    line = _refusal(["--config", str(config)])
    assert line.startswith(f"error: --config {config}: metrics_port {port}: "), line
    assert "front end 0:native" in line and "--metrics-port" not in line, line


def test_an_http_port_flag_taken_by_a_front_end_is_named_by_its_flag(tmp_path: Path) -> None:
    port = free_port()
    line = _refusal(["--config", str(_native_on(tmp_path, port)), "--metrics-port", str(port)])
    assert line.startswith(f"error: --metrics-port {port}: "), line


def test_no_front_end_names_the_config_key_as_well_as_the_flag(tmp_path: Path) -> None:
    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.errors import ConfigError
    from lmcache_tiers.frontend import check_frontends

    try:
        check_frontends(ServerConfig(), None)
    except ConfigError as exc:
        assert "frontends in --config" in str(exc), exc
    else:
        raise AssertionError("a server with no front end was not refused")


def test_an_http_port_clash_names_the_port_setting_of_each_listener(tmp_path: Path) -> None:
    # The HTTP endpoint's port is metrics_port (or the flag that set it), never "port":
    # the refusal names it once, as the user gave it, and "port" only for the front end.
    port = free_port()
    line = _refusal(["--config", str(_native_on(tmp_path, port)), "--metrics-port", str(port)])
    assert line.endswith('change it, or give front end 0:native another "port"'), line
    assert "one of them" not in line, line


class _RefusesItsHost(FrontendConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A third-party front end whose own check refuses a server setting by name."""

    def check(self, server: ServerConfig, auth_token: str | None) -> None:
        raise SettingRefused("host", server.host, "this front end listens on loopback only")


def test_a_front_ends_own_setting_refusal_keeps_its_type_so_serve_names_the_flag() -> None:
    from lmcache_tiers.cli.serve_cmd import name_flag
    from lmcache_tiers.frontend import check_frontends

    server = ServerConfig(host="0.0.0.0", frontends=(FrontendSpec(type="guarded", config=_RefusesItsHost()),))
    try:
        check_frontends(server, None)
    except SettingRefused as exc:
        assert exc.setting == "host", exc
        named = str(name_flag(exc, {"host"}))
        assert named == "--host 0.0.0.0: front end 0:guarded: this front end listens on loopback only", named
    else:
        raise AssertionError("the front end's refusal was lost or lost its type")
