"""A client inherited by a forked child refuses every call there (its socket is the
parent's, whose replies the child would take), while the parent goes on using it, and a
client made in the child works."""

from __future__ import annotations

import os

import pytest

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer

# What the child reports through its exit status.
_REFUSED = 3
_NOT_REFUSED = 4
_OWN_CLIENT_FAILED = 5


def _in_child(server: TiersServer, inherited: Client, keys: list[ObjectKey]) -> int:
    try:
        inherited.lookup(keys)
    except ClientError as exc:
        if "forked child" not in str(exc):
            return _NOT_REFUSED
    else:
        return _NOT_REFUSED
    try:
        with Client(server.endpoint) as own:
            own.ping()
    except Exception:
        return _OWN_CLIENT_FAILED
    return _REFUSED


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_client_is_refused_in_a_forked_child_and_still_works_in_its_parent(server: TiersServer) -> None:
    keys = [ObjectKey("unit", 0, os.urandom(8)) for _ in range(4)]
    with Client(server.endpoint) as client:
        assert client.lookup(keys) == 0
        pid = os.fork()
        if pid == 0:  # the child: report and leave without running the parent's clean-up
            code = _NOT_REFUSED
            try:
                code = _in_child(server, client, keys)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == _REFUSED
        assert client.lookup(keys) == 0
        client.ping()
