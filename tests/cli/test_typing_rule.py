"""One typing rule for --l2-adapter JSON, the --config TOML file and flags.

A value has its field's type: numbers unquoted, switches true/false, text as strings.
NIXL's ``backend_params`` is a map of strings handed to NIXL; bare numbers and booleans
there are taken as their string form, as LMCache takes them.  The same value is
accepted or refused the same way wherever it is written, and a refusal names the full
path of the value.

The cases run the command in this process (``run_cli_in_process``); the last two tests run
the real console script as the end-to-end check of the exit code and the one stderr line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from thirdparty import run_cli, run_cli_in_process

NIXL_PARAMS = {"file_path": "/data/l2", "use_direct_io": "false", "max_capacity_gb": "10"}


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)  # strings, numbers and true/false read the same in TOML


def _via_json(adapter: dict[str, Any]) -> tuple[int, str]:
    result = run_cli_in_process(["serve", "--print-config", "--l2-adapter", json.dumps(adapter)])
    return result.returncode, result.stderr.strip() or result.stdout


def _via_toml(adapter: dict[str, Any], tmp_path: Path) -> tuple[int, str]:
    lines = ["[[l2_adapters]]", *(f"{key} = {_toml_value(value)}" for key, value in adapter.items())]
    path = tmp_path / "tiers.toml"
    path.write_text("\n".join(lines) + "\n")
    result = run_cli_in_process(["serve", "--print-config", "--config", str(path)])
    return result.returncode, result.stderr.strip() or result.stdout


ACCEPTED = [
    {"type": "mock", "max_size_gb": 0.5, "prefault": True},
    {"type": "mock", "max_size_gb": 2},  # an integer where a float is declared
    {"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": NIXL_PARAMS},
    {
        "type": "nixl_store",
        "backend": "POSIX",
        "pool_size": 64,
        "backend_params": {"file_path": "/data/l2", "use_direct_io": "true"},
    },
    # LMCache takes bare numbers and booleans in backend_params and passes their string form
    {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {"file_path": "/d", "use_direct_io": False, "max_capacity_gb": 10},
    },
]

REFUSED = [
    (
        {"type": "mock", "max_size_gb": "0.5"},
        "mock: Expected `float`, got `str` (write the number without quotes: 0.5)"
        " - at `$.l2_adapters[0].max_size_gb`",
    ),
    (
        {"type": "mock", "prefault": "true"},
        "mock: Expected `bool`, got `str` (write true without quotes) - at `$.l2_adapters[0].prefault`",
    ),
    (
        {"type": "mock", "eviction": {"eviction_ratio": "0.3"}},
        "at `$.l2_adapters[0].eviction.eviction_ratio`",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "pool_size": "64",
            "backend_params": {"file_path": "/d", "use_direct_io": "false"},
        },
        "nixl_store: Expected `int`, got `str` (write the number without quotes: 64)"
        " - at `$.l2_adapters[0].pool_size`",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/d", "use_direct_io": "false", "max_capacity_gb": "ten"},
        },
        "nixl_store_dynamic: backend_params.max_capacity_gb must be a number, got 'ten'"
        " - at `$.l2_adapters[0].backend_params.max_capacity_gb`",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/d", "use_direct_io": "maybe", "max_capacity_gb": "1"},
        },
        "at `$.l2_adapters[0].backend_params.use_direct_io`",
    ),
]


@pytest.mark.parametrize("adapter", ACCEPTED, ids=lambda a: str(a["type"]))
def test_json_and_toml_accept_the_same_adapters(adapter: dict[str, Any], tmp_path: Path) -> None:
    code, out = _via_json(adapter)
    assert code == 0, out
    toml_code, toml_out = _via_toml(adapter, tmp_path)
    assert toml_code == 0, toml_out
    assert json.loads(out)["l2_adapters"] == json.loads(toml_out)["l2_adapters"]


@pytest.mark.parametrize(("adapter", "message"), REFUSED, ids=[m.rsplit("`$", 1)[1] for _, m in REFUSED])
def test_json_and_toml_refuse_the_same_way_naming_the_path(
    adapter: dict[str, Any], message: str, tmp_path: Path
) -> None:
    for code, out in (_via_json(adapter), _via_toml(adapter, tmp_path)):
        assert code == 2, out
        assert len(out.splitlines()) == 1 and out.startswith("error: "), out
        assert message in out, out


@pytest.mark.parametrize(
    ("key", "flag", "good", "bad", "toml_message"),
    [
        (
            "l1_size_gb",
            "--l1-size-gb",
            "2",
            '"2"',
            "(write the number without quotes: 2) - at `$.l1_size_gb`",
        ),
        ("port", "--port", "6000", '"6000"', "(write the number without quotes: 6000) - at `$.port`"),
        (
            "gds_l1_use_direct_io",
            "--gds-l1-use-direct-io",
            None,
            '"false"',
            "(write false without quotes) - at `$.gds_l1_use_direct_io`",
        ),
    ],
)
def test_toml_scalars_follow_the_rule_flags_parse_as_the_same_type(
    key: str, flag: str, good: str | None, bad: str, toml_message: str, tmp_path: Path
) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text(f"{key} = {bad}\n")
    refused = run_cli_in_process(["serve", "--print-config", "--no-default-l2", "--config", str(path)])
    assert refused.returncode == 2 and toml_message in refused.stderr, refused.stderr
    path.write_text(f"{key} = {bad.strip(chr(34))}\n")
    accepted = run_cli_in_process(["serve", "--print-config", "--no-default-l2", "--config", str(path)])
    assert accepted.returncode == 0, accepted.stderr
    if good is not None:
        from_flag = run_cli_in_process(["serve", "--print-config", "--no-default-l2", flag, good])
        assert json.loads(from_flag.stdout)[key] == json.loads(accepted.stdout)[key]
        wrong = run_cli_in_process(["serve", "--print-config", "--no-default-l2", flag, "two"])
        assert wrong.returncode == 2 and f"Invalid value for '{flag}'" in wrong.stderr


def test_flag_errors_name_the_flag_and_the_key() -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--l1-size-gb", "-1"])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --l1-size-gb: Expected `float` > 0.0 - at `$.l1_size_gb`"


def test_an_error_about_the_prometheus_port_names_that_flag() -> None:
    result = run_cli(["serve", "--print-config", "--no-default-l2", "--prometheus-port", "70000"])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --prometheus-port: Expected `int` <= 65535 - at `$.metrics_port`"
    )
