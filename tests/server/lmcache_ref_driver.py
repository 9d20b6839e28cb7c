"""LMCache's own MP client, driven line by line (run by the reference venv).

Usage: ``python lmcache_ref_driver.py``; each stdin line is a JSON command, each answer
one JSON line on stdout.  The client (one ``RequestClient``, and the shared-memory transfer
context of the latest registration) lives across commands, so a test can restart the
server between a store and a retrieve and see what LMCache's client code does next.

Commands (``op`` plus fields):
* ``connect``: url; closes the previous client and its mapping, if any, and starts a fresh
  ``RequestClient`` -- one process (its seconds of importing torch and LMCache) then serves
  many tests, each on a client of its own
* ``register``: instance, model, world_size, layers, slots, hidden, dtype; maps the segment
  the server names (LMCache's ``EngineDrivenContextShm``) -> shm_name, pool_size
* ``store``: instance, model, world_size, worker, tokens, start, end, request, seed; fills
  each slot the server offers with bytes derived from ``seed`` and the chunk index, commits
  -> slots offered, committed, sha256 per chunk index
* ``retrieve``: the key fields -> sha256 per chunk, or null for a miss
* ``lookup``: model, world_size, tokens, end, request, readers -> hit chunks, or null

Any command may carry ``timeout_s``: how long each of its requests waits for the server's
answer (LMCache's ``mq_timeout``), 3 s when absent.  A server leaves a request it refuses
unanswered, as LMCache's does, so a test expecting refusals waits them out: a shorter wait
there saves seconds and changes nothing the command returns.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import zmq
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
from lmcache.v1.multiprocess.transfer_context.base import EngineDrivenContextMetadata
from lmcache.v1.multiprocess.transfer_context.shm import EngineDrivenContextShm
from lmcache.v1.multiprocess.transport.base import RequestClient
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

TIMEOUT_S = 3.0


class Driver:
    def __init__(self) -> None:
        self.client: RequestClient | None = None
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.shm: EngineDrivenContextShm | None = None
        self.timeout_s = TIMEOUT_S

    def run(self, c: dict[str, Any]) -> dict[str, Any]:
        """One command, its requests waiting ``timeout_s`` (or the default) for answers."""
        self.timeout_s = float(c.get("timeout_s", TIMEOUT_S))
        if self.shm is not None:
            # LMCache's context reads its mq_timeout at each request: set, it holds for this
            # command only, as the next one sets it again.
            self.shm.mq_timeout = self.timeout_s
        handler = getattr(self, c["op"])
        answer: dict[str, Any] = handler(c)
        return answer

    def connect(self, c: dict[str, Any]) -> dict[str, Any]:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.context is not None:
            self.context.term()  # returns once ZeroMQ has closed every socket of the client
            self.context = None
        # A context per client: LMCache's client binds its socket's monitor to
        # inproc://monitor.s-<the socket's descriptor>, and a closed client gives the
        # descriptor back before ZeroMQ's reaper closes that monitor; a new client in the
        # same context whose socket got the same number failed with "Address already in use".
        self.context = zmq.Context()
        self.context.setsockopt(zmq.LINGER, 0)  # requests a closed client never sent: dropped
        self.client = RequestClientFactory.create(c["url"], context=self.context)
        return {"connected": c["url"]}

    def connected(self) -> RequestClient:
        assert self.client is not None, "connect first"
        return self.client

    def register(self, c: dict[str, Any]) -> dict[str, Any]:
        payload = RegisterEngineDrivenContextPayload(
            instance_id=c["instance"],
            model_name=c["model"],
            world_size=c["world_size"],
            block_size=16,
            num_layers=c["layers"],
            hidden_dim_size=c["hidden"],
            dtype_str=c["dtype"],
            use_mla=False,
            num_physical_slots=c["slots"],
        )
        reply = (
            self.connected().register_kv_cache_engine_driven_context(payload).result(timeout=self.timeout_s)
        )
        shape = torch.Size([2, c["layers"], c["slots"], c["hidden"]])
        metadata = EngineDrivenContextMetadata(
            layout_desc=MemoryLayoutDesc(shapes=[shape], dtypes=[getattr(torch, c["dtype"])]),
            block_size=16,
            use_mla=False,
        )
        if self.shm is not None:
            self.shm.close()
        self.shm = EngineDrivenContextShm(
            metadata, self.connected(), self.timeout_s, reply.shm_name, reply.pool_size
        )
        return {"shm_name": reply.shm_name, "pool_size": reply.pool_size}

    @staticmethod
    def key(c: dict[str, Any], worker: int | None = 0) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=c["model"],
            world_size=c.get("world_size", 1),
            worker_id=worker,
            token_ids=tuple(c["tokens"]),
            start=c.get("start", 0),
            end=c["end"],
            request_id=c["request"],
            num_kv_readers=c.get("readers", 0),
        )

    def store(self, c: dict[str, Any]) -> dict[str, Any]:
        assert self.shm is not None
        key = self.key(c, c.get("worker", 0))
        prepared = self.shm.prepare_store(key, c["instance"])
        if prepared is None:
            return {"slots": None, "committed": False, "digests": {}}
        views, indices = prepared
        digests = {}
        for view, index in zip(views, indices, strict=True):
            flat = view.view(-1)
            values = torch.arange(flat.numel(), dtype=torch.int32).remainder(241) + c["seed"] + 7 * index
            flat.copy_(values.to(flat.dtype))
            digests[index] = sha(view)
        committed = self.shm.commit_store(key, c["instance"], []) if views else False
        return {"slots": len(views), "committed": committed, "digests": digests}

    def retrieve(self, c: dict[str, Any]) -> dict[str, Any]:
        assert self.shm is not None
        key = self.key(c, c.get("worker", 0))
        views = self.shm.prepare_retrieve(key, c["instance"])
        digests = None if views is None else [sha(view) for view in views]
        self.shm.commit_retrieve(key, c["instance"])
        return {"digests": digests}

    def lookup(self, c: dict[str, Any]) -> dict[str, Any]:
        self.connected().lookup(self.key(c, None), 1)
        hits = (
            self.connected()
            .wait_prefetch_status(c["request"], self.timeout_s)
            .result(timeout=self.timeout_s + 2)
        )
        return {"hits": hits}


def sha(view: torch.Tensor) -> str:
    return hashlib.sha256(view.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> int:
    driver = Driver()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = driver.run(command)
        except Exception as exc:  # the test asserts on which calls fail, and how
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
