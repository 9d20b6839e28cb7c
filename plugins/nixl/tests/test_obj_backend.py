"""nixl_store over NIXL's OBJ backend against a real S3 server (SeaweedFS), when available.

One process can load one NIXL wheel, and the CUDA 13 wheel's OBJ plugin needs a library
(libcuobjclient) the CUDA 12 wheel's does not; the transfer therefore runs in a child
process with ``LMCACHE_NIXL_MODULE=nixl_cu12._api``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nixl_helpers import scratch_dir

from lmcache_tiers.testing.seaweedfs import serving

HERE = Path(__file__).parent
ACCESS_KEY, SECRET_KEY, BUCKET = "nixl-test", "nixl-test-secret", "nixl-pool-test"


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "LMCACHE_NIXL_MODULE": "nixl_cu12._api",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }


def obj_plugin_loads() -> str | None:
    """None if nixl_cu12's OBJ plugin loads here, else why not."""
    probe = (
        "from lmcache_plugin_nixl.runtime import NixlRuntime\n"
        "NixlRuntime.shared().agent.agent.getPluginParams('OBJ')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["unknown error"])[-1]


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    reason = obj_plugin_loads()
    if reason is not None:
        pytest.skip(f"NIXL's OBJ plugin does not load with nixl_cu12 here: {reason}")
    with (
        scratch_dir() as data,
        serving(data, buckets=[BUCKET], access_key=ACCESS_KEY, secret_key=SECRET_KEY) as server,
    ):
        yield server.endpoint


def test_obj_pool_round_trip_exhaustion_and_reuse(s3_endpoint: str) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / "obj_roundtrip.py"), s3_endpoint, BUCKET, ACCESS_KEY, SECRET_KEY],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["stored"] == [True, True, True, False]
    assert report["capacity_refusals"] == 1, "the pool holds 3 objects"
    assert report["loaded"] == [True, True, True] and report["equal"] == [True, True, True]
    assert report["deleted"] == [True]
    assert report["stored_after_delete"] == [True]
    assert report["loaded_last"] == [True] and report["last_equal"] is True
