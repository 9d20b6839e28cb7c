"""A front-end refusal names the setting as the user gave it: ``--metrics-port`` only when
that flag set the port, the ``metrics_port`` key when the --config file did."""

from __future__ import annotations

import uuid
from pathlib import Path

from thirdparty import run_cli

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
    line = _refusal(["--config", str(_native_on(tmp_path, port, f"metrics_port = {port}\n"))])
    assert line.startswith(f"error: metrics_port {port}: "), line
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
