"""A refused setting is named as the user gave it: the flag on the command line, the key
in the --config file, or the environment variable -- never a flag the user did not give."""

from __future__ import annotations

import uuid
from pathlib import Path

from thirdparty import run_cli

NARROW = {"COLUMNS": "40"}


def _refusal(args: list[str], **env: str) -> str:
    shm = f"tiers_refusal_{uuid.uuid4().hex[:10]}"
    result = run_cli(
        ["serve", "--print-config", "--no-default-l2", "--shm-name", shm, *args], **NARROW, **env
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_relative_shm_dir_in_the_config_file_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('l1_shm_dir = "relative"\n')
    line = _refusal(["--config", str(config)])
    assert line == f"error: --config {config}: l1_shm_dir relative: give an absolute path", line


def test_a_relative_shm_dir_flag_is_named_by_its_flag() -> None:
    assert _refusal(["--shm-dir", "relative"]) == "error: --shm-dir relative: give an absolute path"


def test_an_l1_smaller_than_one_extent_in_the_config_file_is_named_by_its_key(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text("l1_size_gb = 1e-9\n")
    line = _refusal(["--config", str(config)])
    assert line.startswith(f"error: --config {config}: l1_size_gb 1e-09: smaller than one L1 extent"), line
    assert "--l1-size-gb" not in line and "--l1-align-bytes" not in line, line


def test_a_bad_auth_token_in_the_environment_is_named_by_the_variable() -> None:
    # A byte that is not UTF-8 reaches Python as a lone surrogate.
    line = _refusal([], LMCACHE_TIERS_AUTH_TOKEN="\udcff")
    assert line.startswith("error: LMCACHE_TIERS_AUTH_TOKEN: "), line
    assert "--auth-token" not in line, line


def test_a_bad_auth_token_flag_is_named_by_its_flag() -> None:
    assert _refusal(["--auth-token", "\udcff"]).startswith("error: --auth-token: ")


def test_a_value_of_the_wrong_type_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('l1_size_gb = "x"\n')
    line = _refusal(["--config", str(config)])
    assert line == f"error: --config {config}: Expected `float`, got `str` - at `$.l1_size_gb`", line


def test_an_adapter_of_the_config_file_names_the_file_but_not_one_a_flag_replaced_it_with(
    tmp_path: Path,
) -> None:
    config = tmp_path / "server.toml"
    config.write_text('[[l2_adapters]]\ntype = "fs"\npath = 5\n')
    line = _refusal(["--config", str(config)])
    assert line.startswith(f"error: --config {config}: fs: Expected `str | null`, got `int`"), line
    assert line.endswith("- at `$.l2_adapters[0].path`"), line
    # --l2-adapter replaces the file's adapters: its mistake is not the file's
    line = _refusal(["--config", str(config), "--l2-adapter", '{"type": "fs", "path": 7}'])
    assert "--config" not in line and line.endswith("- at `$.l2_adapters[0].path`"), line


def test_a_value_a_flag_gave_over_the_config_file_names_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text("l1_size_gb = 1.0\n")
    line = _refusal(["--config", str(config), "--l1-size-gb", "-1"])
    assert line.startswith("error: --l1-size-gb: "), line
