"""A root written like a URL without its ``//`` (``file:/x``) has no ``://``, so it would
be served as a local path relative to the working directory: a directory named ``file:``
wherever the server was started, not ``/x``.  It is refused in one line naming the field
and the URL that was probably meant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry


def _decode(raw: dict[str, object]) -> object:
    return decode_adapter(load_registry(), {"type": "fs", **raw}, 0).config


@pytest.mark.parametrize(
    ("field", "root", "meant"),
    [
        ("path", "file:/data/kv", "file:///data/kv"),
        ("base_path", "local:/data/kv", "local:///data/kv"),
        ("path", "s3:/bucket/kv", "s3://bucket/kv"),
        ("path", "memory:kv", "memory://kv"),
    ],
)
def test_a_url_without_its_slashes_is_refused_naming_the_url_meant(field: str, root: str, meant: str) -> None:
    with pytest.raises(ConfigError) as info:
        _decode({field: root})
    message = str(info.value)
    assert f"{field} starts with '{root.split(':')[0]}:'" in message, message
    assert f"did you mean {meant!r}" in message, message
    assert f"$.l2_adapters[0].{field}" in message and "\n" not in message


def test_the_refusal_hides_a_password() -> None:
    with pytest.raises(ConfigError, match="did you mean 'sftp://user:\\*\\*\\*@host/kv'") as info:
        _decode({"path": "sftp:/user:secret@host/kv"})
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("root", ["./file:/data/kv", "file:///data/kv", "/data/file:kv", "memory://kv"])
def test_roots_that_say_what_they_mean_are_taken(root: str) -> None:
    assert _decode({"path": root}).root == root  # type: ignore[attr-defined]


def test_serve_exits_2_with_one_line_and_creates_nothing(tmp_path: Path) -> None:
    adapter = '{"type": "fs", "path": "file:/data/kv"}'
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--print-config", "--l2-adapter", adapter],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you mean 'file:///data/kv'" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []
