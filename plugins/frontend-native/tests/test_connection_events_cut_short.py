"""A signal handler's exception (Ctrl-C) that comes while the client reads its connection
events may come after an event was taken off the monitor and before it was noted.  A drop
lost that way would leave the client trusting its mapping of a server that restarted at
the address since: its stores would copy into the old server's segment and commit, on the
new one, extents nobody wrote."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq
from native_keys import keys_of
from native_restarts import assert_stored_there

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import until_reachable

CHUNK = 4096


def test_a_drop_taken_off_the_monitor_when_a_signal_came_is_not_lost(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    first: TiersServer = make_server(port=port)
    keys = keys_of(2)
    buffers = [np.full(CHUNK, index + 7, dtype=np.uint8) for index in range(len(keys))]
    with Client(first.endpoint, timeout=30) as client:
        monitor = client._monitor
        assert monitor is not None
        first.request_stop()
        assert first.frontends[0].join(30)
        receive = zmq.Socket.recv_multipart

        def received_then_interrupted(self: zmq.Socket[bytes], *args: Any, **kwargs: Any) -> Any:
            frames = receive(self, *args, **kwargs)
            if self is monitor and int.from_bytes(frames[0][:2], "little") == zmq.EVENT_DISCONNECTED:
                raise KeyboardInterrupt  # right after the drop came off the monitor
            return frames

        # Undone however the block ends: left in place, the close of the client would read
        # the drop and raise out of the test, which ends the whole test session.
        with monkeypatch.context() as patched:
            patched.setattr(zmq.Socket, "recv_multipart", received_then_interrupted)
            with pytest.raises(KeyboardInterrupt), client._lock:
                # The drop is reported by the client's I/O thread when it sees the
                # connection close, which may be after the server's frontend ended; the
                # handshake of the first connection is still queued before it.  So the
                # events are read as they come until the drop is among them.
                while True:
                    assert monitor.poll(30_000, zmq.POLLIN), "the drop was never reported"
                    client._read_link_events()
        second: TiersServer = make_server(port=port)
        until_reachable(client)
        assert client.store(keys, buffers) == 2
        assert_stored_there(second.endpoint, keys, buffers)
