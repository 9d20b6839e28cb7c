"""L2 adapter ``s3``: one object per chunk in an S3 bucket, through s3fs.

A light manifest: the config Struct and the registration.  s3fs and the backend are
imported only when an ``s3`` adapter is configured.
"""

from __future__ import annotations

from lmcache_plugin_s3.config import S3Config
from lmcache_tiers.plugin import KindRegistry, hookimpl

__all__ = ["S3Config", "tiers_register_l2_adapters"]


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("s3", "lmcache_plugin_s3.backend:S3Backend", S3Config)
