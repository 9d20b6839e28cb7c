"""A connection that sends pickled ``prepare_retrieve`` calls without reading the replies
is answered misses once its replies not read yet reach ``max_message_mb``, instead of the
server queueing a copy of the chunks for every request until the kernel kills it; another
client is served its own bytes meanwhile."""

from __future__ import annotations

import pickle
import time
from typing import Any

import msgspec
import torch
import zmq
from lmcache_plugin_lmcache_mp.wire import OPERATION_IDS
from mp_counts import mp_stats
from mpclient import (
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    pickled_chunks,
    tokens_of,
    wait_for,
)

REG = Registration()
CHUNK = REG.object_bytes
#: each a reply of four chunks (512 KiB) the greedy client never reads: 100 MiB in all
REQUESTS = 200


def unpickled(data: bytes) -> list[bytes]:
    return [tensor.contiguous().view(torch.uint8).numpy().tobytes() for tensor in pickle.loads(data)]


def test_a_client_not_reading_its_pickled_replies_is_answered_misses_past_its_bound(
    make_mp_server: Any,
) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, max_message_mb=1)
    stats = mp_stats(server)
    url = mp_address(server)
    context = zmq.Context()
    greedy = context.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)  # its replies back up into the server's queue
    greedy.setsockopt(zmq.RCVBUF, 4096)
    try:
        with MPClient(url) as reader:
            reader.register(REG)
            big, small = Key(tokens_of(1), "big", worker_id=0), Key(tokens_of(2, 256), "small", worker_id=0)
            small_chunk = chunk_payloads(2, 1, CHUNK)
            big_chunks = pickled_chunks(chunk_payloads(1, 4, CHUNK))
            assert reader.call("commit_store", big.encode(), REG.instance_id, big_chunks) is True
            assert reader.call("commit_store", small.encode(), REG.instance_id, pickled_chunks(small_chunk))
            served_before = stats.retrieves
            greedy.connect(url)
            encode = msgspec.msgpack.encode
            for uid in range(REQUESTS):
                op = encode(OPERATION_IDS["prepare_retrieve"])
                greedy.send_multipart([encode(uid), op, encode(big.encode()), encode(REG.instance_id)])
            read = 0
            deadline = time.monotonic() + 120  # a server that never gets to them fails the test

            def greedy_done() -> bool:
                greedy_served = stats.retrieves - served_before - read
                return greedy_served + stats.failures["mp_replies_unread"] >= REQUESTS

            while not greedy_done():
                assert time.monotonic() < deadline, "the server never got to the greedy client's requests"
                # served throughout, and its own bytes
                reply = reader.call("prepare_retrieve", small.encode(), REG.instance_id)
                assert reply["success"] is True
                assert unpickled(reply["data"]) == small_chunk
                read += 1
            refused = stats.failures["mp_replies_unread"]
            # Each request served queued a reply the client does not read: at most the
            # bound's worth beyond what the kernel's socket buffers took.
            assert refused > 0
            assert REQUESTS - refused < REQUESTS // 2
            wait_for(lambda: server.storage.status()["l1"]["read_locks"] == 0, "read locks given back")
    finally:
        greedy.close(0)
        context.term()
