"""Eviction policy ``S3FIFO`` (also spelled ``S3-FIFO``): three FIFO queues."""

from __future__ import annotations

from typing import Annotated

import msgspec

from lmcache_tiers.plugin import ComponentConfig, KindRegistry, hookimpl


class S3FIFOConfig(ComponentConfig):
    """S3-FIFO: new keys enter a small FIFO queue and leave it quickly unless read again,
    reused keys cycle through a main FIFO queue, and a ghost queue of keys evicted from the
    small one sends them straight to the main queue when they come back.  Within one batch
    the tail of the prefix goes first."""

    small_queue_fraction: Annotated[
        float,
        msgspec.Meta(gt=0.0, lt=1.0, description="Share of the live keys the small FIFO queue holds."),
    ] = 0.1
    max_frequency: Annotated[
        int,
        msgspec.Meta(ge=1, le=15, description="Reads counted per key (each read buys one more pass)."),
    ] = 3


_FACTORY = "lmcache_plugin_eviction_s3fifo.policy:S3FIFOEvictionPolicy"


@hookimpl
def tiers_register_eviction_policies(registry: KindRegistry) -> None:
    registry.add("S3FIFO", _FACTORY, S3FIFOConfig)
    # Names resolve case-insensitively; the hyphenated spelling of the paper is its own name.
    registry.add("S3-FIFO", _FACTORY, S3FIFOConfig, "Alias of S3FIFO.")
