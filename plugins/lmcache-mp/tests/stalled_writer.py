"""A client process that prepares a one-chunk store and then never copies nor commits,
as one killed or stalled mid-store (it maps the segment, as a client about to copy):
``python stalled_writer.py URL INSTANCE_ID SEQUENCE [ROUTING_ID]`` (a routing identity
of its own choosing, as a client may set).  It prints a line once its prepare is
answered with a slot, then waits for ever."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import zmq
from mpclient import CHUNK_TOKENS, Key, MPClient, Registration, tokens_of


def main() -> None:
    url, instance_id, sequence = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    client = MPClient(url)
    if len(sys.argv) > 4:
        client.socket.close(0)
        client.socket = client.context.socket(zmq.DEALER)
        client.socket.setsockopt(zmq.LINGER, 0)
        client.socket.setsockopt(zmq.ROUTING_ID, sys.argv[4].encode())
        client.socket.connect(url)
    registration = Registration(instance_id=instance_id)
    shm_name = client.register(registration)["shm_name"]
    if shm_name:
        client.segment(shm_name)  # mapped, as a client copying into it: the writer
    key = Key(tokens_of(sequence), f"stalled-{sequence}", worker_id=0, end=CHUNK_TOKENS)
    reply = client.call("prepare_store", key.encode(), instance_id)
    slots = reply["context"]["slots"]
    print(f"prepared {len(slots)}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
