"""A key written where its location belongs (``key_env`` or ``key_file`` holding the key
itself, a common slip) is refused without being quoted: the error line and
``--print-config`` never show it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEX_KEY = "3c" * 32
BASE64_KEY = base64.b64encode(bytes(range(1, 33))).decode()
CLI = Path(sys.executable).parent / "lmcache-tiers"


def serve(tmp_path: Path, serde: dict[str, object], *flags: str) -> subprocess.CompletedProcess[str]:
    adapter = {"type": "fs", "path": str(tmp_path / "l2"), "serde": [serde]}
    return subprocess.run(
        [
            str(CLI),
            "serve",
            "--no-shm",
            "--l1-size-gb",
            "0.01",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--l2-adapter",
            json.dumps(adapter),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("field", ["key_env", "key_file"])
@pytest.mark.parametrize("key", [HEX_KEY, BASE64_KEY], ids=["hex", "base64"])
@pytest.mark.parametrize("flags", [(), ("--print-config",)], ids=["serve", "print-config"])
def test_a_key_written_in_place_of_its_location_is_refused_unquoted(
    tmp_path: Path, field: str, key: str, flags: tuple[str, ...]
) -> None:
    result = serve(tmp_path, {"type": "aesgcm", field: key}, *flags)
    assert result.returncode != 0
    assert key not in result.stdout + result.stderr
    assert f"{field} holds a 256-bit key itself" in result.stderr


def test_a_variable_name_is_still_accepted(tmp_path: Path) -> None:
    result = serve(tmp_path, {"type": "aesgcm", "key_env": "KV_KEY"}, "--print-config")
    assert result.returncode == 0, result.stderr
    assert '"key_env": "KV_KEY"' in result.stdout


@pytest.mark.parametrize(
    "key",
    [
        "0x" + HEX_KEY,
        base64.urlsafe_b64encode(bytes(range(200, 232))).decode(),
        base64.b64encode(bytes(range(64))).decode(),
    ],
    ids=["0x-hex", "urlsafe-base64", "512-bit-base64"],
)
def test_a_key_in_another_encoding_written_as_key_env_is_not_quoted(tmp_path: Path, key: str) -> None:
    """A key that is no variable name, in an encoding the key check does not know (a
    ``0x`` prefix, URL-safe base64, another length), is refused as a name without the
    refusal quoting it."""
    result = serve(tmp_path, {"type": "aesgcm", "key_env": key}, "--print-config")
    assert result.returncode == 2
    assert key not in result.stdout + result.stderr
    assert "key_env is not an environment variable name" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
