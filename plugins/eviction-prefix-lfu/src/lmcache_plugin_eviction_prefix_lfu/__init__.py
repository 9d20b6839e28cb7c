"""Eviction policy ``PREFIX_LFU``: recency plus a frequency credit, for prefix KV traffic."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class PrefixLFUConfig(ComponentConfig):
    """Least recently used first, except that every doubling of a chunk's uses buys it
    `frequency_credit` cache turnovers more; use counts outlive eviction, so a prompt sent
    again regains its standing at once.  A request's tail (the last chunk it stored, and
    chunks stored right after reading the prefix they extend) starts `tail_penalty`
    turnovers behind; a prefix head never ranks below its own tail."""

    frequency_credit: Annotated[
        float,
        msgspec.Meta(ge=0.0, le=64.0, description="Cache turnovers a chunk gains per doubling of its uses."),
    ] = 2.0
    tail_penalty: Annotated[
        float,
        msgspec.Meta(ge=0.0, le=64.0, description="Cache turnovers a request's tail chunks start behind."),
    ] = 1.0
    history_factor: Annotated[
        int,
        msgspec.Meta(ge=0, le=1024, description="Use counts remembered for evicted chunks, per live chunk."),
    ] = 4
    history_min: Annotated[
        int,
        msgspec.Meta(ge=0, le=1 << 30, description="Use counts remembered for evicted chunks at least."),
    ] = 65536


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add(
        "PREFIX_LFU", "lmcache_plugin_eviction_prefix_lfu.policy:PrefixLFUEvictionPolicy", PrefixLFUConfig
    )
