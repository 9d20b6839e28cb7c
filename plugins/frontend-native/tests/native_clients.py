"""Clients the native front end's tests share."""

from __future__ import annotations

from lmcache_tiers.client import Client
from lmcache_tiers.wire import protocol as p


class OtherProcessClient(Client):
    """A client that says HELLO with another process's pid (init's, which maps no arena):
    what it names is never taken for what a client of this process reserved under an
    earlier connection (a commit or abort of keys a client of the same process holds no
    reservation of names those, see test_write_fence.py)."""

    def _greet(self, timeout: float | None = None) -> p.HelloReply:
        hello = p.Hello(0, self._token, p.PROTOCOL_VERSION, self._name, 1)
        return self._call(hello, p.HelloReply, timeout=timeout)
