"""Two nixl_store adapters on one object backend would share their slot objects.

NIXL takes one set of parameters per backend and process, so every nixl_store adapter on
OBJ (or AZURE_BLOB) in a server writes to the same bucket (container), under the same
fixed object names: each one's stores overwrite the other's acknowledged objects.  The
second such adapter is refused, at open and in the pre-flight.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from lmcache_plugin_nixl.config import NixlStoreConfig
from lmcache_plugin_nixl.store import NixlStoreBackend
from nixl_helpers import serve_refusal
from test_obj_backend import ACCESS_KEY, BUCKET, HERE, SECRET_KEY, child_env, s3_endpoint  # noqa: F401

from lmcache_tiers.config import FieldError
from lmcache_tiers.l2.preflight import preflight_claims


def test_a_second_pool_on_one_object_backend_is_refused_at_open(s3_endpoint: str) -> None:  # noqa: F811
    done = subprocess.run(
        [sys.executable, str(HERE / "obj_two_pools.py"), s3_endpoint, BUCKET, ACCESS_KEY, SECRET_KEY],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["stored"] == [True]
    assert report["second"].startswith("refused: FieldError: another nixl_store adapter"), report
    assert report["loaded"] == [True] and report["equal"] is True
    assert report["corrupt_slots_dropped"] == 0


def test_serve_refuses_a_second_pool_on_one_object_backend_naming_it(s3_endpoint: str) -> None:  # noqa: F811
    params = {
        "bucket": BUCKET,
        "endpoint_override": s3_endpoint,
        "access_key": ACCESS_KEY,
        "secret_key": SECRET_KEY,
        "scheme": "http",
        "region": "us-east-1",
    }
    adapter = {"type": "nixl_store", "backend": "OBJ", "backend_params": params, "pool_size": 2}
    error, output = serve_refusal([adapter, adapter], child_env())
    assert "another nixl_store adapter of this server keeps its pool in the OBJ backend" in error
    assert error.endswith("- at `$.l2_adapters[1].backend`"), error
    assert "Traceback" not in output


@pytest.mark.parametrize("backend", ["OBJ", "AZURE_BLOB"])
def test_a_second_pool_on_one_object_backend_is_refused_in_the_preflight(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pre-flight's endpoint probe is not what is tested here.
    monkeypatch.setattr("lmcache_plugin_nixl.store.check_before_l1", lambda *args: None)
    params = {"bucket": "b"} if backend == "OBJ" else {"account_url": "http://h", "container_name": "c"}
    config = NixlStoreConfig(backend=backend, backend_params=params, pool_size=2)
    with preflight_claims():
        NixlStoreBackend.preflight(config)
        with pytest.raises(FieldError) as caught:
            NixlStoreBackend.preflight(config)
    assert caught.value.field == "backend"
    assert f"another nixl_store adapter of this server keeps its pool in the {backend} backend" in str(
        caught.value
    )


def test_pools_on_file_backends_are_not_claimed_per_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setattr("lmcache_plugin_nixl.store.check_before_l1", lambda *args: None)
    with preflight_claims():
        for name in ("a", "b"):
            params = {"file_path": str(tmp_path / name), "use_direct_io": "false"}
            NixlStoreBackend.preflight(NixlStoreConfig(backend="POSIX", backend_params=params, pool_size=2))
