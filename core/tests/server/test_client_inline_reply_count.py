"""An inline RETRIEVE answered with more objects than keys asked is a protocol error, as
it is over shared memory: which payload belongs to which key cannot be told, so none is
handed out, and the locks this client holds on the keys are given back.  The extra
payloads used to be handed out as views beyond the keys asked.

No real server answers so; a ROUTER socket in the test speaks the wire format instead."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from lmcache_tiers.client import Client, ProtocolError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.threads import joined
from lmcache_tiers.wire import protocol as p

PAYLOAD = b"\x5a" * 64


class _OverAnsweringPeer:
    """Answers HELLO (no segment), every inline RETRIEVE with one object more than asked,
    and RELEASE, noting the keys released."""

    def __init__(self) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port: int = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.released: list[ObjectKey] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="over-answering-peer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(50):
                continue
            identity, header, *_ = self.socket.recv_multipart()
            request = p.request_decoder.decode(header)
            reply: Any
            frames: list[bytes] = []
            if isinstance(request, p.Hello):
                reply = p.HelloReply(request.req_id, max_inline_bytes=1 << 20, features=list(p.FEATURES))
            elif isinstance(request, p.Retrieve):
                count = len(request.keys) + 1
                reply = p.RetrieveReply(request.req_id, slots=[p.Slot(0, len(PAYLOAD))] * count)
                frames = [PAYLOAD] * count
            elif isinstance(request, p.Release):
                self.released.extend(request.keys)
                reply = p.ReleaseReply(request.req_id, released=len(request.keys))
            else:
                reply = p.PingReply(request.req_id)
            self.socket.send_multipart([identity, p.encode(reply), *frames])

    def close(self) -> None:
        self._stop.set()
        joined(self._thread, "the fake peer")
        self.socket.close(0)


@pytest.fixture
def peer() -> Iterator[_OverAnsweringPeer]:
    serving = _OverAnsweringPeer()
    yield serving
    serving.close()


@pytest.mark.parametrize("call", ["retrieve", "retrieve_into"])
def test_an_inline_retrieve_answered_with_more_objects_than_keys_fails_closed(
    peer: _OverAnsweringPeer, call: str
) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(2)]
    with Client(peer.url, timeout=5.0) as client:
        assert not client.uses_shm
        targets = [np.zeros(len(PAYLOAD), dtype=np.uint8) for _ in keys]
        with pytest.raises(ProtocolError, match="3 slots for 2 keys"):
            if call == "retrieve":
                with client.retrieve(keys) as views:
                    pytest.fail(f"{len(views)} views handed out for {len(keys)} keys")
            else:
                client.retrieve_into(keys, targets)
        assert not any(target.any() for target in targets)
        assert peer.released == keys
