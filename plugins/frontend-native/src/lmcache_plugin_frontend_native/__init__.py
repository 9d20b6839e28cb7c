"""Front end ``native``: lmcache-tiers' own protocol (docs/server.md), served by default.

Requests and replies are msgspec Structs in msgpack over a ZeroMQ ROUTER; local clients
copy KV bytes straight into and out of the L1 shared-memory segment
(:class:`lmcache_tiers.client.Client` speaks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import msgspec

from lmcache_tiers.plugin import (
    ConfigError,
    FrontendConfig,
    KindRegistry,
    hookimpl,
    is_loopback,
    wire_protocol,
)

if TYPE_CHECKING:
    from lmcache_tiers.plugin import ServerConfig

AUTH_TOKEN_ENV = "LMCACHE_TIERS_AUTH_TOKEN"


class NativeConfig(FrontendConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """lmcache-tiers' own protocol, with the shared-memory data plane (lmcache_tiers.client)."""

    max_inline_bytes: Annotated[
        int, msgspec.Meta(ge=1, description="Largest payload of an inline STORE/RETRIEVE, in bytes.")
    ] = 256 << 20
    max_request_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description=(
                "Largest total of a request's payload frames, in bytes "
                "(its header, at most 4 MiB, is bounded on its own)."
            ),
        ),
    ] = 1 << 30
    pool_workers: Annotated[
        int, msgspec.Meta(ge=1, le=256, description="Threads for blocking requests (waits, inline copies).")
    ] = 8
    max_keys_per_request: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=wire_protocol.MAX_KEYS_PER_REQUEST,
            description=(
                "Most keys one request may name; HELLO tells clients, which split larger batches, "
                "and a request over it is refused (TOO_LARGE). One request holds the loop serving "
                "every client for its keys' worth of work: lower it to bound that."
            ),
        ),
    ] = wire_protocol.MAX_KEYS_PER_REQUEST

    def check(self, server: ServerConfig, auth_token: str | None) -> None:
        self.endpoint(server)
        largest = max(self.max_request_bytes, self.max_inline_bytes)  # what the loop takes
        self.check_pool_bound(server, largest, "max_request_bytes or max_inline_bytes")
        host, _ = self.address(server)
        if not is_loopback(host) and not auth_token:
            raise ConfigError(
                f"binding to {host} (not loopback) requires --auth-token, {AUTH_TOKEN_ENV} "
                "or auth_token in --config"
            )
        if auth_token is not None and len(auth_token) > wire_protocol.MAX_TOKEN_LEN:
            raise ConfigError(
                f"the auth token is {len(auth_token)} characters long; the protocol carries at most "
                f"{wire_protocol.MAX_TOKEN_LEN}"
            )


@hookimpl
def tiers_register_frontends(registry: KindRegistry) -> None:
    registry.add("native", "lmcache_plugin_frontend_native.frontend:NativeFrontend", NativeConfig)
