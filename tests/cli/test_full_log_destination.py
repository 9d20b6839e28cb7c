"""serve's stdout and stderr redirected to a file on a full filesystem: every log line and
the banner are lost, and nothing of that reaches a request (logging's own handler error
path swallows the write failure)."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from thirdparty import free_port, launch_l1_only_serve

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.mounts import tmpfs_at


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "full"
    with tmpfs_at(str(directory), "size=1m") as refused:
        if refused is not None:
            pytest.skip(refused)
        with pytest.raises(OSError), (directory / "filler").open("wb") as filler:
            filler.write(b"x" * (2 << 20))
            filler.flush()
        yield directory


def test_serve_logging_to_a_full_filesystem_keeps_serving(full_tmpfs: Path) -> None:
    port = free_port()
    shm = f"tiers_fulllog_{uuid.uuid4().hex[:10]}"
    with (full_tmpfs / "serve.log").open("w") as out:
        proc = launch_l1_only_serve(
            out,
            shm_name=shm,
            port=port,
            LMCACHE_LOG_LEVEL="DEBUG",  # a log call on every request
        )
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            for index in range(200):
                key = ObjectKey("m", 0, hashlib.blake2b(str(index).encode(), digest_size=32).digest(), 0, "")
                payload = bytes([index % 251]) * 8192
                client.store([key], [payload])
                assert client.lookup([key]) == 1
                with client.retrieve([key]) as views:
                    assert bytes(views[0]) == payload
        assert proc.poll() is None
    finally:
        proc.terminate()
        assert proc.wait(120) == 0
    assert not os.path.exists(f"/dev/shm/{shm}")
    assert "L1 arena" not in (full_tmpfs / "serve.log").read_text()  # the start-up log was lost
