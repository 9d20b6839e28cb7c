"""A store's body carries its CRC32 (``x-amz-checksum-crc32``): a body damaged on its way
to the store is refused there rather than stored, where only a later read would find it."""

from __future__ import annotations

import pytest
from flipping_relay import FlippingRelay
from s3_helpers import Raw, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3

SIZE = 256 << 10


@pytest.fixture
def prefix() -> str:
    return fresh_prefix("upload-integrity")


def test_an_upload_damaged_on_the_way_is_refused_by_the_store_and_sent_again(
    seaweed: SeaweedS3, prefix: str, l1: memoryview, opened: list[L2Adapter]
) -> None:
    with FlippingRelay(seaweed.endpoint) as relay:
        adapter = open_adapter(s3_config(seaweed, prefix, endpoint_url=relay.endpoint), l1)
        opened.append(adapter)
        (key,) = make_keys(1)
        payload = pattern(5, SIZE)
        l1[:SIZE] = payload
        # Counted from a run of payload bytes the HTTP head cannot hold: inside the body.
        relay.flip_once(after=SIZE // 2, marker=payload[1000:1032], upload=True)
        assert blocking(adapter).store([key], [l1[:SIZE]]) == [True]
        assert relay.flipped == 1, "no byte was flipped: the test tested nothing"
    # What the store holds is the body sent again, intact: loaded back and verified.
    assert Raw(seaweed, prefix).read(key)[-SIZE:] == payload, "the damaged body was stored"
    assert adapter.stats()["store_damaged_in_transit"] == 1
    l1[SIZE : 2 * SIZE] = bytes(SIZE)
    direct = open_adapter(s3_config(seaweed, prefix), l1)
    opened.append(direct)
    assert blocking(direct).lookup_and_lock([key]).found == [True]
    assert blocking(direct).load([key], [l1[SIZE : 2 * SIZE]]) == [True]
    assert bytes(l1[SIZE : 2 * SIZE]) == payload
    assert direct.stats().get("damage_not_repeated", 0) == 0
    direct.unlock([key])
