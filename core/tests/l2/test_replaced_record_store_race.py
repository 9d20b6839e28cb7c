"""A load that finds another writer's record under a key's name releases what the adapter
accounted for the key -- but not the entry of a store of the key that lands while the
load judges that record: its record is in the store, and forgotten, its bytes would be
held there uncounted and the eviction policy told they were deleted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import DictBackend, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.record import RecordError, verify_payload
from lmcache_tiers.testing.blocking import BlockingAdapterClient

SIZE = 4096


class UnlockedReads(DictBackend):
    """Judges the records it loads outside its lock, as a file store reads its files: a
    store of a key may land while a load of the key judges the record it read."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            values = [self.objects.get(key) for key in keys]
        done = []
        for key, value, buffer in zip(keys, values, buffers, strict=True):
            done.append(value is not None and self._load(key, value, buffer))
        return done

    def _load(self, key: ObjectKey, value: bytes, buffer: memoryview) -> bool:
        try:
            header = self.context.read_record_header(value, key)
        except RecordError as exc:
            if not self.context.kept_record(key, exc):
                with self.lock:
                    if self.objects.get(key) is value:
                        self._drop_corrupt(key)
            return False
        if header is None:
            return False
        payload = memoryview(value)[header.header_len :]
        verify_payload(header, payload)
        if payload.nbytes != buffer.nbytes:
            return False
        buffer[:] = payload
        return True


def test_a_store_landing_while_a_load_judges_a_replaced_record_stays_accounted(
    adapters: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = open_dict(UnlockedReads, records=True)
    adapters.append(adapter)
    assert isinstance(adapter, BackendAdapter)
    backend = adapter.backend
    assert isinstance(backend, UnlockedReads)
    client = BlockingAdapterClient(adapter, timeout=10)
    key, other = ObjectKey("replaced", 0, b"\x01" * 8), ObjectKey("replaced", 0, b"\x02" * 8)
    data = memoryview(bytes(range(256)) * (SIZE // 256))
    assert client.store([key], [data]) == [True]
    # Another writer's record now lies under the key's name.
    backend.objects[key] = backend.context.record_header(other, data) + bytes(data)

    # While the load judges that record, a store of the key lands (this adapter's write
    # back of it): first thing when the adapter reads what it accounts for the key.
    accounting = adapter.state.accounting
    read_accounted = accounting.get
    stored_meanwhile: list[list[bool]] = []

    def store_lands_first(asked: ObjectKey) -> Any:
        if asked == key and not stored_meanwhile:
            stored_meanwhile.append(client.store([key], [data]))
        return read_accounted(asked)

    monkeypatch.setattr(accounting, "get", store_lands_first)
    assert client.load([key], [memoryview(bytearray(SIZE))]) == [False]
    monkeypatch.undo()

    assert stored_meanwhile == [[True]], "no store landed while the load judged the record"
    stats = adapter.stats()
    assert stats.get("foreign_records") == 1
    assert accounting.get(key) is not None, "the store that landed was forgotten"
    assert stats.get("objects_vanished", 0) == 0
    assert adapter.used_bytes() == SIZE
    out = memoryview(bytearray(SIZE))
    assert client.load([key], [out]) == [True]
    assert bytes(out) == bytes(data)
