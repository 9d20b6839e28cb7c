"""A listener or L1 directory refused at start-up is named as the user gave it: the flag
on the command line, the key in the --config file -- never a flag the user did not give."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from thirdparty import free_port, run_cli

NARROW = {"COLUMNS": "40"}


def _serve_refused(args: list[str], size: list[str] | None = None, port: bool = True) -> str:
    """``port``: give --port (not where every front end gives its own: it is then refused)."""
    shm = f"tiers_named_{uuid.uuid4().hex[:10]}"
    result = run_cli(
        [
            "serve",
            "--no-default-l2",
            *(["--l1-size-gb", "0.25"] if size is None else size),
            "--shm-name",
            shm,
            *(["--port", str(free_port())] if port else []),
            *args,
        ],
        **NARROW,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not os.path.exists(f"/dev/shm/{shm}")
    return lines[0]


def test_a_metrics_port_in_use_set_in_the_config_file_is_named_by_its_key(
    taken_port: int, tmp_path: Path
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(f"metrics_port = {taken_port}\n")
    line = _serve_refused(["--config", str(config)])
    assert line.startswith(
        f"error: --config {config}: metrics_port {taken_port}: 127.0.0.1:{taken_port} is already in use"
    ), line
    assert "--metrics-port" not in line, line


def test_a_metrics_port_in_use_set_by_its_flag_is_named_by_the_flag(taken_port: int) -> None:
    line = _serve_refused(["--metrics-port", str(taken_port)])
    assert line.startswith(f"error: --metrics-port {taken_port}: 127.0.0.1:{taken_port} is already in use"), (
        line
    )


def test_a_host_in_the_config_file_that_is_not_ours_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('host = "192.0.2.1"\nauth_token = "t"\n')
    line = _serve_refused(["--metrics-port", "0", "--config", str(config)])
    assert line == (
        f"error: --config {config}: host 192.0.2.1: not an address of this machine; give one of its addresses"
    ), line


def test_a_missing_shm_dir_in_the_config_file_is_named_by_its_key(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    config = tmp_path / "server.toml"
    config.write_text(f'l1_shm_dir = "{missing}"\n')
    line = _serve_refused(["--metrics-port", "0", "--config", str(config)])
    assert line.startswith(f"error: --config {config}: l1_shm_dir {missing}: does not exist"), line


def test_a_missing_shm_dir_flag_is_named_by_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    line = _serve_refused(["--metrics-port", "0", "--shm-dir", str(missing)])
    assert line.startswith(f"error: --shm-dir {missing}: does not exist"), line


def test_an_l1_too_large_in_the_config_file_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text("l1_size_gb = 100000\n")
    line = _serve_refused(["--metrics-port", "0", "--config", str(config)], size=[])
    assert line.startswith(f"error: --config {config}: l1_size_gb 100000: /dev/shm has"), line
    assert "--l1-size-gb" not in line, line


def test_an_l1_too_large_by_its_flag_is_named_by_the_flag() -> None:
    line = _serve_refused(["--metrics-port", "0"], size=["--l1-size-gb", "100000"])
    assert line.startswith("error: --l1-size-gb 100000: /dev/shm has"), line


def test_a_front_end_port_in_use_set_in_the_config_file_is_named_by_the_file(
    taken_port: int, tmp_path: Path
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(f'[[frontends]]\ntype = "native"\nport = {taken_port}\n')
    line = _serve_refused(["--metrics-port", "0", "--config", str(config)], port=False)
    in_use = f"$.frontends[0].port {taken_port}: 127.0.0.1:{taken_port} is already in use"
    assert line.startswith(f"error: --config {config}: {in_use}"), line


def test_a_front_end_port_in_use_set_by_its_flag_does_not_name_the_config_file(
    taken_port: int, tmp_path: Path
) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[[frontends]]\ntype = "native"\n')
    frontend = f'{{"type": "native", "port": {taken_port}}}'
    line = _serve_refused(
        ["--metrics-port", "0", "--config", str(config), "--frontend", frontend], port=False
    )
    in_use = f"$.frontends[0].port {taken_port}: 127.0.0.1:{taken_port} is already in use"
    assert line.startswith(f"error: {in_use}"), line
