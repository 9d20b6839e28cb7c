"""An object store's endpoint holding credentials (``user:password@host:port``, with or
without a scheme) would be printed by ``--print-config`` and named by the start-up probe's
error line; NIXL takes the credentials as ``access_key``/``secret_key``, so it is refused,
without being quoted."""

from __future__ import annotations

import json

import pytest
from nixl_helpers import serve_refusal
from test_obj_backend import BUCKET, child_env, s3_endpoint  # noqa: F401 - the S3 server fixture

from lmcache_tiers.config import parse_adapter_json
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

SECRET = "obj-s3cret"


@pytest.mark.parametrize(
    ("backend", "params"),
    [
        ("OBJ", {"bucket": "b", "endpoint_override": f"user:{SECRET}@10.0.0.1:9000"}),
        ("OBJ", {"bucket": "b", "endpoint_override": f"http://user:{SECRET}@10.0.0.1:9000/"}),
        (
            "AZURE_BLOB",
            {"account_url": f"https://user:{SECRET}@acct.blob.core.windows.net", "container_name": "c"},
        ),
    ],
    ids=["obj-bare", "obj-url", "azure-url"],
)
def test_an_endpoint_with_credentials_is_refused_unquoted(backend: str, params: dict[str, str]) -> None:
    raw = {"type": "nixl_store", "backend": backend, "pool_size": 2, "backend_params": params}
    with pytest.raises(ConfigError) as refused:
        parse_adapter_json(load_registry(), json.dumps(raw), 0)
    assert SECRET not in str(refused.value)
    assert "credentials are not accepted in backend_params." in str(refused.value)


def test_an_at_sign_past_the_authority_is_no_credential() -> None:
    raw = {
        "type": "nixl_store",
        "backend": "OBJ",
        "pool_size": 2,
        "backend_params": {"bucket": "b", "endpoint_override": "http://10.0.0.1:9000/a@b"},
    }
    assert parse_adapter_json(load_registry(), json.dumps(raw), 0).type == "nixl_store"


def test_two_obj_adapters_with_other_credentials_are_refused_without_showing_them(
    s3_endpoint: str,  # noqa: F811 - the fixture imported above
) -> None:
    # One NIXL agent per process: the second adapter's OBJ parameters would have to equal
    # the first's, and then its pool would be the first's objects in the same bucket, so a
    # second nixl_store adapter on OBJ is refused outright; the keys stay unshown.
    adapters = [
        {
            "type": "nixl_store",
            "backend": "OBJ",
            "pool_size": 2,
            "backend_params": {
                "bucket": BUCKET,
                "endpoint_override": s3_endpoint,
                "access_key": f"access-{n}",
                "secret_key": f"{SECRET}-{n}",
            },
        }
        for n in (1, 2)
    ]
    error, output = serve_refusal(adapters, child_env())
    assert "another nixl_store adapter of this server keeps its pool in the OBJ backend" in error
    assert SECRET not in output
    assert "access-1" not in output
