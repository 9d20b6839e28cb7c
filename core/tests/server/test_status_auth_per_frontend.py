"""``/status`` says whether clients must present the auth token, and which front ends
check it: the native front end does; LMCache's MP protocol carries no token, so a server
whose only front end is ``lmcache_mp`` requires none even when a token is configured (it
guards the HTTP endpoint off loopback then).  Saying ``auth_required: true`` there would
tell an operator the cache is protected when anyone who reaches the port is served."""

from __future__ import annotations

from collections.abc import Callable

from lmcache_tiers.server.app import TiersServer

TOKEN = "s3cret-token-for-status"

Factory = Callable[..., TiersServer]


def _auth_by_frontend(server: TiersServer) -> dict[str, bool]:
    return {entry["type"]: entry["auth_required"] for entry in server.status()["frontends"]}


def test_a_token_only_lmcache_mp_serves_is_not_reported_as_required(make_server: Factory) -> None:
    server = make_server(frontends=[{"type": "lmcache_mp"}], server_options={"auth_token": TOKEN})
    assert server.status()["server"]["auth_required"] is False
    assert _auth_by_frontend(server) == {"lmcache_mp": False}


def test_the_native_front_end_checks_the_token_next_to_lmcache_mp(make_server: Factory) -> None:
    server = make_server(
        frontends=[{"type": "native"}, {"type": "lmcache_mp", "port": 0}],
        server_options={"auth_token": TOKEN},
    )
    assert server.status()["server"]["auth_required"] is True
    assert _auth_by_frontend(server) == {"native": True, "lmcache_mp": False}


def test_no_token_no_front_end_requires_one(make_server: Factory) -> None:
    server = make_server(frontends=[{"type": "native"}, {"type": "lmcache_mp", "port": 0}])
    assert server.status()["server"]["auth_required"] is False
    assert _auth_by_frontend(server) == {"native": False, "lmcache_mp": False}
