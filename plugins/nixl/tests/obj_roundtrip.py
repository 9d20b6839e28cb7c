"""Child process of the OBJ test: nixl_store over NIXL's OBJ backend against an S3 server.

Run as ``python obj_roundtrip.py ENDPOINT BUCKET ACCESS_KEY SECRET_KEY`` with
``LMCACHE_NIXL_MODULE`` naming a NIXL wheel whose OBJ plugin loads.  Prints one JSON line
with what happened, for the parent test to assert on.
"""

from __future__ import annotations

import json
import sys

import msgspec
from lmcache_plugin_nixl.config import NixlStoreConfig
from nixl_helpers import Arena, client, open_pool

from lmcache_tiers.testing.l2 import make_keys, pattern


def main(endpoint: str, bucket: str, access_key: str, secret_key: str) -> None:
    params = {
        "bucket": bucket,
        "endpoint_override": endpoint,
        "access_key": access_key,
        "secret_key": secret_key,
        "scheme": "http",
        "region": "us-east-1",
    }
    config = msgspec.convert({"backend": "OBJ", "backend_params": params, "pool_size": 3}, NixlStoreConfig)
    arena = Arena(32 << 20)
    adapter = open_pool(config, arena.view)
    report: dict[str, object] = {}
    try:
        keys = make_keys(4)
        data = [pattern(i, 200_000 + 4096 * i) for i in range(4)]
        report["stored"] = client(adapter).store(keys, [arena.filled(d) for d in data])
        buffers = [arena.take(len(d)) for d in data[:3]]
        report["loaded"] = client(adapter).load(keys[:3], buffers)
        report["equal"] = [bytes(b) == d for b, d in zip(buffers, data, strict=False)]
        report["capacity_refusals"] = adapter.stats().get("capacity_refusals", 0)
        report["deleted"] = adapter.delete(keys[:1])
        report["stored_after_delete"] = client(adapter).store(keys[3:], [arena.filled(data[3])])
        target = arena.take(len(data[3]))
        report["loaded_last"] = client(adapter).load(keys[3:], [target])
        report["last_equal"] = bytes(target) == data[3]
    finally:
        adapter.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
