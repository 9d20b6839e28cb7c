"""Serde configs through the CLI: decoded from --l2-adapter JSON, shown by `plugins show`,
and no key material in any output."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from thirdparty import run_cli

from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.ports import free_port

KEY = bytes(range(7, 39))
KEY_FORMS = (KEY.hex(), KEY.hex().upper(), base64.b64encode(KEY).decode(), repr(KEY))


def _no_key_in(*texts: str) -> None:
    for text in texts:
        for form in KEY_FORMS:
            assert form not in text, "key material in the output"


def _adapter(*serdes: dict[str, object]) -> str:
    return json.dumps({"type": "mock", "max_size_gb": 0.01, "serde": list(serdes)})


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    return path


def test_serde_specs_decode_from_adapter_json(key_file: Path) -> None:
    chain = (
        {"type": "fp8", "fp8_dtype": "float8_e5m2", "granularity": "channel"},
        {"type": "ZSTD", "level": 7, "element_size": 2},
        {"type": "aesgcm", "key_file": str(key_file)},
    )
    config = build_config(load_registry(), adapter_json=[_adapter(*chain)])
    specs = config.l2_adapters[0].serde
    assert [spec.type for spec in specs] == ["fp8", "zstd", "aesgcm"]
    assert specs[0].config.format == "e5m2" and specs[0].config.granularity == "channel"  # type: ignore[attr-defined]
    assert specs[1].config.level == 7 and specs[1].config.element_size == 2  # type: ignore[attr-defined]
    assert specs[2].config.key_file == str(key_file)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("serde", "message"),
    [
        ({"type": "zstd", "level": 99}, "serde[0].level"),
        ({"type": "fp8", "format": "e3m4"}, "serde[0].format"),
        ({"type": "fp8", "format": "e5m2", "fp8_dtype": "float8_e4m3fn"}, "contradicts"),
        ({"type": "aesgcm"}, "exactly one of key_file or key_env"),
        ({"type": "aesgcm", "key_env": "K", "key": "00"}, "serde[0]"),
        ({"type": "zstdd"}, "did you mean 'zstd'"),
    ],
)
def test_bad_serde_specs_are_config_errors(serde: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_config(load_registry(), adapter_json=[_adapter(serde)])


def test_print_config_shows_the_chain_but_no_key(key_file: Path) -> None:
    chain = (
        {"type": "fp8", "fp8_dtype": "float8_e4m3fn"},
        {"type": "zstd"},
        {"type": "aesgcm", "key_env": "TIERS_KEY_UNDER_TEST"},
        {"type": "aesgcm", "key_file": str(key_file)},
    )
    result = run_cli(
        ["serve", "--print-config", "--l2-adapter", _adapter(*chain)], TIERS_KEY_UNDER_TEST=KEY.hex()
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["l2_adapters"][0]["serde"]
    assert shown == [
        {"type": "fp8", "format": "e4m3fn", "granularity": "tensor", "fp8_dtype": None},
        {"type": "zstd", "level": 1, "shuffle": True, "element_size": None},
        {
            "type": "aesgcm",
            "key_file": None,
            "key_env": "TIERS_KEY_UNDER_TEST",
            "read_key_files": [],
            "read_key_envs": [],
            "per_salt_keys": True,
            "read_unbound_frames": True,
        },
        {
            "type": "aesgcm",
            "key_file": str(key_file),
            "key_env": None,
            "read_key_files": [],
            "read_key_envs": [],
            "per_salt_keys": True,
            "read_unbound_frames": True,
        },
    ]
    _no_key_in(result.stdout, result.stderr)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("serde-fp8", ("format", "granularity", "fp8_dtype")),
        ("serde-zstd", ("level", "shuffle", "element_size")),
        ("serde-aesgcm", ("key_file", "key_env", "per_salt_keys")),
        ("serde:aesgcm", ("key_file", "key_env", "per_salt_keys")),
    ],
)
def test_plugins_show_documents_each_serde(name: str, fields: tuple[str, ...], key_file: Path) -> None:
    result = run_cli(["plugins", "show", name], COLUMNS="200", TIERS_KEY_UNDER_TEST=KEY.hex())
    assert result.returncode == 0, result.stderr
    assert "serde:" in result.stdout
    for field in fields:
        assert field in result.stdout
    _no_key_in(result.stdout, result.stderr)


@pytest.mark.parametrize(
    ("key_setup", "message"),
    [
        ("missing", "cannot be read: No such file or directory"),
        ("short", "holds no 256-bit key"),
        ("env-unset", "environment variable TIERS_KEY_ABSENT is not set"),
    ],
)
def test_a_bad_key_stops_serve_with_one_line(tmp_path: Path, key_setup: str, message: str) -> None:
    path = tmp_path / "key"
    if key_setup == "short":
        path.write_bytes(KEY[:20])
    source = {"key_env": "TIERS_KEY_ABSENT"} if key_setup == "env-unset" else {"key_file": str(path)}
    args = ["serve", "--l1-size-gb", "0.01", "--port", str(free_port()), "--metrics-port", "0", "--no-shm"]
    result = run_cli([*args, "--l2-adapter", _adapter({"type": "aesgcm", **source})], COLUMNS="400")
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    # refused by the pre-flight, before L1 is pre-faulted (the serde itself reads it after)
    assert errors[0].endswith(" - at `$.l2_adapters[0].serde[0]`"), errors[0]
    assert "Traceback" not in result.stderr
    _no_key_in(result.stdout, result.stderr)
