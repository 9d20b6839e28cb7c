"""STORE_RESERVE, STORE_COMMIT and STORE_ABORT from two clients, checked step by step
against a model of what each must answer: new keys, keys named twice, keys already stored,
keys another client reserved, partial commits.  The handlers answer some of these (every
key reserved, every key committed) without their per-key bookkeeping; whichever way a
request is answered, the answer must be the model's."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
from native_clients import OtherProcessClient

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

STEPS = 120
POOL = 6  # keys per round: small, so that lists repeat keys and clients meet on them
ROUND = 12  # steps per pool of keys


@dataclass
class Model:
    """Keys stored, live reservations by client, and the counters a commit moves."""

    stored: set[ObjectKey] = field(default_factory=set)
    reserved: dict[ObjectKey, tuple[int, int]] = field(default_factory=dict)  # key -> (client, size)
    stores: int = 0
    chunks: int = 0
    stored_bytes: int = 0

    def reserve(self, client: int, keys: list[ObjectKey], sizes: list[int]) -> list[bool]:
        given: list[bool] = []
        for key, size in zip(keys, sizes, strict=True):
            new = key not in self.stored and key not in self.reserved
            if new:
                self.reserved[key] = (client, size)
            given.append(new)
        return given

    def take(self, client: int, keys: list[ObjectKey]) -> list[tuple[ObjectKey, int] | None]:
        """The client's reservations among ``keys`` (first naming only), taken away."""
        taken: list[tuple[ObjectKey, int] | None] = []
        for key in keys:
            holder = self.reserved.get(key)
            if holder is not None and holder[0] == client:
                del self.reserved[key]
                taken.append((key, holder[1]))
            else:
                taken.append(None)
        return taken

    def commit(self, client: int, keys: list[ObjectKey]) -> list[bool]:
        taken = self.take(client, keys)
        done = [entry for entry in taken if entry is not None]
        self.stored.update(key for key, _ in done)
        if done:
            self.stores += 1
            self.chunks += len(done)
            self.stored_bytes += sum(size for _, size in done)
        return [entry is not None for entry in taken]

    def abort(self, client: int, keys: list[ObjectKey]) -> list[bool]:
        return [entry is not None for entry in self.take(client, keys)]


def pick_keys(rng: random.Random, pool: list[ObjectKey], model: Model, client: int) -> list[ObjectKey]:
    """A key list: often exactly the client's reservations (in any order), else any keys
    of the pool, names repeated or not."""
    mine = [key for key, (holder, _) in model.reserved.items() if holder == client]
    if mine and rng.random() < 0.4:
        rng.shuffle(mine)
        return mine
    if rng.random() < 0.4:
        return rng.sample(pool, rng.randint(1, len(pool)))  # distinct
    return [rng.choice(pool) for _ in range(rng.randint(1, 2 * len(pool)))]


@pytest.mark.parametrize("seed", range(4))
def test_store_requests_answer_as_the_model_does(server: TiersServer, seed: int) -> None:
    rng = random.Random(seed)
    model = Model()
    # Of two processes: a client names only what it reserved, or (after a drop) what its
    # process reserved under an earlier connection, which the model leaves out.
    with Client(server.endpoint) as first, OtherProcessClient(server.endpoint) as second:
        clients = [first, second]
        pool: list[ObjectKey] = []
        for step in range(STEPS):
            if step % ROUND == 0:
                prefix = os.urandom(8)
                pool = [ObjectKey("unit", 0, prefix + bytes([index])) for index in range(POOL)]
            index = rng.randrange(2)
            client = clients[index]
            keys = pick_keys(rng, pool, model, index)
            action = rng.choice(("reserve", "reserve", "commit", "abort"))
            if action == "reserve":
                sizes = [4096 * rng.randint(1, 4) for _ in keys]
                expected = model.reserve(index, keys, sizes)
                slots = client._call(p.StoreReserve(0, "", keys, sizes), p.StoreReserveReply).slots
                assert [slot.offset != p.NO_SLOT for slot in slots] == expected, (step, keys)
                assert [slot.size for slot in slots] == sizes
            elif action == "commit":
                expected = model.commit(index, keys)
                assert client._call(p.StoreCommit(0, "", keys), p.StoreReply).done == expected, (step, keys)
            else:
                expected = model.abort(index, keys)
                assert client._call(p.StoreAbort(0, "", keys), p.StoreReply).done == expected, (step, keys)
        for index, client in enumerate(clients):
            leftover = [key for key, (holder, _) in model.reserved.items() if holder == index]
            if leftover:
                client._call(p.StoreAbort(0, "", leftover), p.StoreReply)
    ((_, stats),) = server.frontend_stats()
    counted = (stats.stores, stats.store_chunks, stats.store_bytes)
    assert counted == (model.stores, model.chunks, model.stored_bytes)
    l1 = server.storage.status()["l1"]
    assert (l1["objects"], l1["write_locked"]) == (len(model.stored), 0)
