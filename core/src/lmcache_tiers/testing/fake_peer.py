"""A fake native server for client tests: a ROUTER socket on loopback that speaks the wire
format and answers as the test says, for the answers no real server gives (a hit count that
is no prefix of the keys, more objects than keys asked), which only a peer of the test's
own can send."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.threads import joined
from lmcache_tiers.wire import protocol as p

__all__ = ["FakePeer", "PeerAnswer", "PeerReply"]

#: a reply and the payload frames sent after it
PeerReply = tuple[msgspec.Struct, Sequence[bytes]]
#: the test's answer to a request, or None to leave the request to the peer's own answers
PeerAnswer = Callable[[Any], PeerReply | None]

#: how often the serving thread looks whether the peer was closed
_POLL_MS = 50


class FakePeer:
    """Serves on ``url`` until closed: HELLO with a reply offering no shared-memory segment
    (``hello`` adds fields, such as ``max_inline_bytes``), each request ``answer`` answers
    as it returns, RELEASE with the count of keys released (noted in ``released``, in
    order) and anything else with a PING reply."""

    def __init__(self, answer: PeerAnswer, *, name: str, hello: dict[str, Any] | None = None) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port: int = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.released: list[ObjectKey] = []
        self._answer = answer
        self._hello = dict(hello or {})
        self._stop = threading.Event()
        #: what ended the serving thread early (an answer that raised): raised again by
        #: :meth:`close`, or the test would see only its client timing out
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._serve_until_closed()
        except BaseException as exc:
            self._failed = exc

    def _serve_until_closed(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(_POLL_MS):
                continue
            identity, header, *_ = self.socket.recv_multipart()
            request = p.request_decoder.decode(header)
            reply, frames = self._reply_to(request)
            self.socket.send_multipart([identity, p.encode(reply), *frames])

    def _reply_to(self, request: Any) -> PeerReply:
        if isinstance(request, p.Hello):
            return p.HelloReply(request.req_id, features=list(p.FEATURES), **self._hello), ()
        answered = self._answer(request)
        if answered is not None:
            return answered
        if isinstance(request, p.Release):
            self.released.extend(request.keys)
            return p.ReleaseReply(request.req_id, released=len(request.keys)), ()
        return p.PingReply(request.req_id), ()

    def close(self) -> None:
        self._stop.set()
        joined(self._thread, f"the fake peer {self._thread.name}")
        self.socket.close(0)
        if self._failed is not None:
            raise AssertionError(f"the fake peer {self._thread.name} stopped serving") from self._failed

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
