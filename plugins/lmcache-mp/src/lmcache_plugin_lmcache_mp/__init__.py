"""Front end ``lmcache_mp``: LMCache's multi-process server protocol (``lmcache server``).

LMCache clients -- ``lmcache bench server``, vLLM's LMCache MP connector in engine-driven
mode -- talk to lmcache-tiers as they talk to LMCache's own server: ZeroMQ, LMCache's frames,
operation ids and payload maps, the same keys for the same tokens, and the L1 arena as the
shared-memory segment they copy KV chunks into and out of.  docs/frontends/lmcache-mp.md
says how to point a client here and what is supported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from lmcache_tiers.plugin import SHM_DIR, ConfigError, FrontendConfig, KindRegistry, hookimpl, is_loopback

if TYPE_CHECKING:
    from lmcache_tiers.plugin import ServerConfig


def _doc(text: str, **constraints: Any) -> Any:
    return msgspec.Meta(description=text, **constraints)


class LMCacheMPConfig(FrontendConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """LMCache's multi-process protocol, for LMCache clients and vLLM's LMCache MP connector."""

    allow_remote: Annotated[
        bool,
        _doc("Listen beyond loopback. The protocol carries no credentials: a trusted network only."),
    ] = False
    shm: Annotated[
        bool,
        _doc(
            "Offer the L1 shared-memory segment at registration: clients copy chunks into and "
            "out of it. false: chunks travel pickled (needs allow_pickle)."
        ),
    ] = True
    allow_pickle: Annotated[
        bool,
        _doc(
            "Accept chunks as pickled torch tensors (clients that cannot map the segment). Only "
            "tensors are unpickled, yet torch's loader runs on client bytes: trusted clients "
            "only. Needs torch on the server."
        ),
    ] = False
    workers: Annotated[
        int,
        _doc("Threads for requests that wait or copy (prefetch waits, clear, pickled chunks).", ge=1, le=64),
    ] = 4
    lookup_wait_ms: Annotated[
        float,
        _doc(
            "How long a lookup that goes to L2 waits for its prefetch before it answers, so the "
            "client's first status query has the result (LMCache's bench polls every 50 ms, "
            "vLLM's connector once per scheduler step).",
            ge=0.0,
            le=10_000.0,
        ),
    ] = 20.0
    session_ttl_s: Annotated[
        float, _doc("Seconds an idle request (its hashes, its lookup) is kept.", gt=0.0)
    ] = 600.0
    max_requests: Annotated[int, _doc("Requests remembered at once; the least recent go first.", ge=1)] = (
        65536
    )
    max_request_keys: Annotated[
        int,
        _doc(
            "Most L1 objects one request may name: a lookup's chunks times the world size, a "
            "store's or retrieve's chunks. Beyond it the request is refused (a lookup is 0 hits, "
            "a store gets no slots, a retrieve misses), counted as mp_request_too_large. A "
            "128k-token prompt in chunks of 256 at world size 8 names 4096. Also the most keys "
            "a connection's shared-memory retrieves prepared and not committed yet may name "
            "before its next one misses (mp_retrieves_uncommitted).",
            ge=1,
        ),
    ] = 1 << 20
    max_remembered_mb: Annotated[
        int,
        _doc(
            "MiB the remembered requests may take together: their ids (beyond the first KiB), "
            "tokens (4 bytes each), chunk hashes and their lookups' keys (about 180 bytes "
            "each). Beyond it the least "
            "recently seen requests are forgotten (mp_request_dropped_memory); a request "
            "needing more by itself is refused (mp_request_too_large).",
            ge=1,
        ),
    ] = 1024
    worker_reap_timeout_s: Annotated[
        float,
        _doc(
            "Seconds a worker that pinged may stay silent before it is reaped "
            "(mp_instance_reaped): its read locks are released, but its unfinished stores "
            "are left to the write TTL (l1_write_ttl_s) and then fenced, since a silent "
            "client may be one stalled before its copy.",
            gt=0.0,
        ),
    ] = 120.0
    worker_registration_grace_s: Annotated[
        float, _doc("Seconds a worker that never pinged stays registered.", gt=0.0)
    ] = 3600.0
    max_message_mb: Annotated[
        int,
        # ZeroMQ takes the limit as an int64 of bytes; a msgpack bin (the pickled chunks of
        # one commit_store) holds at most 4 GiB anyway.
        _doc(
            "Largest request frame in MiB (pickled chunks); a larger one disconnects its client. "
            "Also the most a connection's unread pickled retrieve replies may hold before it is "
            "answered misses.",
            ge=1,
            le=4096,
        ),
    ] = 1024

    def check(self, server: ServerConfig, auth_token: str | None) -> None:
        self.endpoint(server)
        # The largest message the loop reads: a commit_store's pickled chunks.
        self.check_pool_bound(server, self.max_message_mb << 20, "max_message_mb")
        host, _ = self.address(server)
        if not is_loopback(host) and not self.allow_remote:
            raise ConfigError(
                f'listening on {host} (not loopback) needs "allow_remote": true; LMCache\'s protocol '
                "carries no credentials, so only on a trusted network"
            )
        no_segment = server.no_shm or server.gds_l1_path is not None
        if (not self.shm or no_segment) and not self.allow_pickle:
            reason = (
                '"shm" is false'
                if not self.shm
                else 'L1 has no shared-memory segment (--no-shm, --shm-name "" or --gds-l1-path)'
            )
            raise ConfigError(f'{reason}, so chunks can only travel pickled: set "allow_pickle": true')
        if self.shm and not no_segment and not _is_dev_shm(server.l1_shm_dir):
            # Registration names the segment as a POSIX shared-memory name, which LMCache
            # clients open with shm_open, i.e. in /dev/shm: elsewhere they cannot find it.
            raise ConfigError(
                f"the lmcache_mp front end offers the L1 segment by its POSIX shared-memory name, "
                f"which LMCache clients open in /dev/shm, not in --shm-dir {server.l1_shm_dir}: "
                'drop --shm-dir (remount /dev/shm with huge=always for huge pages), or set "shm": '
                'false with "allow_pickle": true'
            )
        if self.allow_pickle and importlib.util.find_spec("torch") is None:
            raise ConfigError('"allow_pickle" needs torch installed on the server (pip install torch)')


def _is_dev_shm(directory: str) -> bool:
    return os.path.realpath(directory) == os.path.realpath(SHM_DIR)


@hookimpl
def tiers_register_frontends(registry: KindRegistry) -> None:
    registry.add("lmcache_mp", "lmcache_plugin_lmcache_mp.frontend:LMCacheMPFrontend", LMCacheMPConfig)
