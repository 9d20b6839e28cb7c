"""The configuration reference says what reaping a silent worker does to its stores.

test_write_fence.py's test_the_reservations_of_a_reaped_instance_are_not_handed_to_other_chunks
checks the behaviour: a reaped instance's unfinished stores are not aborted (their extents
would go to the next store while the stalled client may still copy) but left to the write
TTL, then fenced.  The field's description is what docs/configuration.md prints.
"""

from __future__ import annotations

import msgspec
from lmcache_plugin_lmcache_mp import LMCacheMPConfig


def test_reap_timeout_says_unfinished_stores_wait_for_the_write_ttl() -> None:
    info = msgspec.inspect.type_info(LMCacheMPConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    (field,) = [f for f in info.fields if f.name == "worker_reap_timeout_s"]
    assert isinstance(field.type, msgspec.inspect.Metadata)
    description = " ".join((field.type.extra_json_schema or {}).get("description", "").split())
    assert "left to the write TTL" in description and "fenced" in description
