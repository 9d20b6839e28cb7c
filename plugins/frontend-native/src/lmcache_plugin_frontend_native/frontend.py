"""The native front end: the RPC loop and its handlers, behind the front-end contract.

The loop (:class:`~lmcache_plugin_frontend_native.rpc.RpcServer`) runs on a thread of its
own; the socket is bound when the front end is built, so an address in use fails the
server's start-up before anything is served.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from lmcache_plugin_frontend_native import NativeConfig
from lmcache_plugin_frontend_native.handlers import DataPlane, Handlers
from lmcache_plugin_frontend_native.rpc import RpcServer
from lmcache_tiers.plugin import SHM_DIR, FrontendContext, FrontendStats, segment_identity
from lmcache_tiers.plugin import wire_protocol as p


def data_plane_of(context: FrontendContext) -> DataPlane:
    """The shared-memory segment HELLO advertises, or none (inline only)."""
    l1 = context.storage.l1
    if context.server.no_shm or not l1.is_memory:
        return DataPlane()
    arena = l1.arena
    device, inode = segment_identity(arena.name, arena.directory)
    return DataPlane(
        arena.name,
        arena.segment_size,
        device,
        inode,
        arena.generation_offset,
        arena.generation_block,
        # the default stays "", which every client reads as /dev/shm
        "" if arena.directory == SHM_DIR else arena.directory,
    )


class NativeFrontend:
    """lmcache-tiers' own protocol on one ROUTER socket."""

    #: every request carries the auth token when the server has one (``rpc.py`` compares it)
    checks_auth_token = True

    def __init__(self, config: NativeConfig, context: FrontendContext) -> None:
        self.name = context.name
        self.config = config
        self._context = context
        self._stats = FrontendStats()
        self.data_plane = data_plane_of(context)
        self.handlers = Handlers(
            context.storage,
            chunk_size=context.server.chunk_size,
            data_plane=self.data_plane,
            stats=self._stats,
            status_provider=context.status,
            max_inline_bytes=config.max_inline_bytes,
            max_keys=config.max_keys_per_request,
        )
        self.rpc = RpcServer(
            self.handlers,
            context.endpoint,
            name=context.name,
            auth_token=context.auth_token,
            pool_workers=config.pool_workers,
            drain_timeout_s=context.drain_timeout_s,
            max_request_bytes=max(config.max_request_bytes, config.max_inline_bytes),
            # one inline chunk up to the advertised limit must fit in one frame
            max_frame_bytes=config.max_inline_bytes + p.MAX_HEADER_BYTES,
            max_pool_bytes=context.server.frontend_pool_max_mb << 20,
        )

    @property
    def address(self) -> str:
        return self.rpc.endpoint

    def start(self) -> None:
        self.rpc.start(self._context.fatal)

    def stop(self, *, force: bool = False) -> None:
        self.rpc.request_stop(force=force)

    def join(self, timeout: float | None = None) -> bool:
        return self.rpc.router.join(timeout)

    def stats(self) -> FrontendStats:
        """The counters, with the client gauges counted now.

        Scrapes call this from their own threads: the gauges are read from the sessions
        (which only the loop thread changes) into a copy, so they are current without a
        sweep having run and nothing here writes what the loop thread writes."""
        gauges = self.handlers.sessions.gauges(time.monotonic())
        return dataclasses.replace(
            self._stats,
            sessions=gauges.clients,
            locked_keys=gauges.locked_keys,
            reserved_stores=gauges.reserved_stores,
            pending_prefetches=gauges.pending_prefetches,
        )

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": "native",
            "address": self.address,
            "protocol_version": p.PROTOCOL_VERSION,
            "shm_segment": self.data_plane.shm_name or None,
            "shm_dir": (self.data_plane.shm_dir or SHM_DIR) if self.data_plane.shm_name else None,
            "draining": self.rpc.draining,
            **self.stats().snapshot(),
        }

    def health(self) -> tuple[bool, str]:
        return self.rpc.router.health()

    def describe(self) -> str:
        auth = "auth token required" if self._context.auth_token else "no auth, loopback only"
        plane = self.data_plane
        if plane.shm_name:
            data = f"shared memory {os.path.join(plane.shm_dir or SHM_DIR, plane.shm_name)}"
        elif not self._context.storage.l1.is_memory:
            data = "inline bytes (L1 is a file)"
        else:
            data = "inline bytes (--no-shm)"
        return f"native protocol v{p.PROTOCOL_VERSION} ({auth}), {data}"
