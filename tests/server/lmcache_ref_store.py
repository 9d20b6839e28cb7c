"""Store chunks through a server with LMCache's own client code (run by the reference venv).

Usage: ``python lmcache_ref_store.py URL MODEL`` with LMCache 0.5.6 importable.  It
registers an engine-driven context, stores two chunks of ``(7,) + (9906,) * 512`` with
LMCache's shared-memory transfer context (its prepare_store, its tensor views of the
segment, its commit_store) and prints JSON: whether it was stored and the sha256 of each chunk's
bytes, for the caller to compare with what another client reads back.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import zmq
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
from lmcache.v1.multiprocess.transfer_context.base import EngineDrivenContextMetadata
from lmcache.v1.multiprocess.transfer_context.shm import EngineDrivenContextShm
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

INSTANCE = 4242
LAYERS, SLOTS, HIDDEN = 2, 256, 64


def main() -> int:
    url, model = sys.argv[1], sys.argv[2]
    context = zmq.Context()
    client = RequestClientFactory.create(url, context=context)
    payload = RegisterEngineDrivenContextPayload(
        instance_id=INSTANCE,
        model_name=model,
        world_size=1,
        block_size=16,
        num_layers=LAYERS,
        hidden_dim_size=HIDDEN,
        dtype_str="bfloat16",
        use_mla=False,
        num_physical_slots=SLOTS,
    )
    reply = client.register_kv_cache_engine_driven_context(payload).result(timeout=10)
    shape = torch.Size([2, LAYERS, SLOTS, HIDDEN])
    metadata = EngineDrivenContextMetadata(
        layout_desc=MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16]), block_size=16, use_mla=False
    )
    shm = EngineDrivenContextShm(metadata, client, 10.0, reply.shm_name, reply.pool_size)
    tokens = (7,) + (9906,) * 512
    key = IPCCacheServerKey(
        model_name=model,
        world_size=1,
        worker_id=0,
        token_ids=tokens,
        start=0,
        end=512,
        request_id="ref-store",
    )
    prepared = shm.prepare_store(key, INSTANCE)
    assert prepared is not None, "the server offered no shared-memory slots"
    views, indices = prepared
    digests = {}
    for view, index in zip(views, indices, strict=True):
        values = torch.arange(view.numel(), dtype=torch.int32).remainder(251) + 3 * index
        view.copy_(values.to(torch.bfloat16).view(shape))
        digests[index] = hashlib.sha256(view.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    stored = shm.commit_store(key, INSTANCE, [])
    shm.close()
    client.close()
    context.term()
    print(json.dumps({"stored": stored, "digests": [digests[i] for i in sorted(digests)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
