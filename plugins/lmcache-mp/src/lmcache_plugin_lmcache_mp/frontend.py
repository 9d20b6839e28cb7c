"""The LMCache MP front end behind the front-end contract."""

from __future__ import annotations

import logging
from typing import Any

from lmcache_plugin_lmcache_mp import LMCacheMPConfig
from lmcache_plugin_lmcache_mp.base import Shared
from lmcache_plugin_lmcache_mp.handlers import Handlers
from lmcache_plugin_lmcache_mp.loop import MPServer
from lmcache_plugin_lmcache_mp.state import RequestTable
from lmcache_tiers.plugin import FrontendContext, FrontendStats, is_loopback

logger = logging.getLogger(__name__)

PICKLE_WARNING = (
    "%s: the pickle data path is ON (allow_pickle): the server unpickles KV chunks sent by "
    "clients. Only torch tensors are rebuilt, but torch's loader then reads client bytes: "
    "let only trusted clients reach %s"
)
REMOTE_WARNING = (
    "%s: listening on %s beyond loopback (allow_remote): LMCache's protocol carries no "
    "credentials, so anyone who can reach this address can read and overwrite cached KV "
    "data; firewall it to trusted clients"
)


class LMCacheMPFrontend:
    """LMCache's multi-process protocol on one ROUTER socket."""

    #: LMCache's protocol carries no credentials: whoever reaches the address is served
    checks_auth_token = False

    def __init__(self, config: LMCacheMPConfig, context: FrontendContext) -> None:
        self.name = context.name
        self.config = config
        self._context = context
        storage = context.storage
        l1 = storage.l1
        shm = None
        if config.shm and l1.is_memory and not context.server.no_shm:
            # Offsets in slots are absolute in the segment; clients map all of it.
            shm = (l1.arena.name, l1.arena.size)
        codec = None
        if config.allow_pickle:
            from lmcache_plugin_lmcache_mp.pickled import PickleCodec  # imports torch

            codec = PickleCodec()
        self.shared = Shared(
            storage=storage,
            config=config,
            stats=FrontendStats(),
            chunk_size=context.server.chunk_size,
            shm=shm,
            pickle=codec,
            lock_ttl_s=float(l1.lock_ttl_s),
            write_ttl_s=float(l1.write_ttl_s),
            requests=RequestTable(config.max_requests, config.max_remembered_mb << 20),
        )
        self.handlers = Handlers(self.shared)
        self.loop = MPServer(
            self.handlers,
            context.endpoint,
            name=self.name,
            workers=config.workers,
            max_frame_bytes=config.max_message_mb << 20,
            drain_timeout_s=context.drain_timeout_s,
            max_pool_bytes=context.server.frontend_pool_max_mb << 20,
        )
        if codec is not None:
            logger.warning(PICKLE_WARNING, self.name, self.loop.router.endpoint)
        host, _ = config.address(context.server)
        if not is_loopback(host):
            logger.warning(REMOTE_WARNING, self.name, self.loop.router.endpoint)

    @property
    def address(self) -> str:
        return self.loop.router.endpoint

    def start(self) -> None:
        self.loop.start(self._context.fatal)

    def stop(self, *, force: bool = False) -> None:
        self.loop.request_stop(force=force)

    def join(self, timeout: float | None = None) -> bool:
        return self.loop.router.join(timeout)

    def stats(self) -> FrontendStats:
        return self.shared.stats

    def status(self) -> dict[str, Any]:
        shared = self.shared
        # Called from HTTP threads while the loop thread registers and reaps instances:
        # the table is copied in one step (list() of a dict view, which the loop cannot
        # interleave) rather than iterated live, which raises once it changes size.
        instances = list(shared.instances.values())
        return {
            "name": self.name,
            "type": "lmcache_mp",
            "address": self.address,
            "data_path": self._data_path(),
            "instances": [
                {
                    "instance_id": instance.instance_id,
                    "model_name": instance.model_name,
                    "world_size": instance.world_size,
                    "layout": instance.layout_text,
                    "pinged": instance.pinged,
                }
                for instance in instances
            ],
            "requests": len(shared.requests),
            "draining": self.loop.router.draining,
            **shared.stats.snapshot(),
        }

    def _data_path(self) -> str:
        shm = self.shared.shm
        if shm is not None:
            pickled = (
                ", PICKLED CHUNKS ACCEPTED (trusted clients only)" if self.shared.pickle is not None else ""
            )
            return f"shared memory /dev/shm/{shm[0]}{pickled}"
        return "PICKLED CHUNKS (allow_pickle: trusted clients only)"

    def health(self) -> tuple[bool, str]:
        return self.loop.router.health()

    def describe(self) -> str:
        auth = "remote allowed, no auth" if self.config.allow_remote else "no auth, loopback only"
        return f"LMCache MP protocol ({auth}), {self._data_path()}"
