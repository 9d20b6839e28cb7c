"""Child process of the shared-bucket test: two nixl_store adapters over NIXL's OBJ backend
in one process, against an S3 server.

Run as ``python obj_two_pools.py ENDPOINT BUCKET ACCESS_KEY SECRET_KEY`` with
``LMCACHE_NIXL_MODULE`` naming a NIXL wheel whose OBJ plugin loads.  Prints one JSON line:
how the second adapter's open ended, and whether the first still loads what it stored.
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
    # NIXL takes one set of parameters per backend and process: a second adapter on OBJ
    # names the same bucket, whatever it is given.
    config = msgspec.convert({"backend": "OBJ", "backend_params": params, "pool_size": 2}, NixlStoreConfig)
    arena = Arena(8 << 20)
    first = open_pool(config, arena.view)
    report: dict[str, object] = {}
    try:
        ours, theirs = make_keys(2)
        data = pattern(1, 100_000)
        report["stored"] = client(first).store([ours], [arena.filled(data)])
        try:
            second = open_pool(config, arena.view)
        except Exception as exc:
            report["second"] = f"refused: {type(exc).__name__}: {exc}"
        else:
            report["second"] = "opened"
            try:
                client(second).store([theirs], [arena.filled(pattern(2, 100_000))])
            finally:
                second.close()
        target = arena.take(len(data))
        report["loaded"] = client(first).load([ours], [target])
        report["equal"] = bytes(target) == data
        report["corrupt_slots_dropped"] = first.stats().get("corrupt_slots_dropped", 0)
    finally:
        first.close()
    # Once the first adapter is closed, its bucket may take another.
    again = open_pool(config, arena.view)
    again.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
