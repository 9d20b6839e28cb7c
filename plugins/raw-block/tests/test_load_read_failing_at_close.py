"""A load that passed the closing check and reaches the device once close released it
fails its read: a miss, as it must be, but one the close caused -- counted as a load
stopped by the close, not as a read error of the device."""

from __future__ import annotations

import errno
from pathlib import Path

from rb_helpers import backend_of, config, open_raw, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 9000


def test_a_read_failing_because_the_adapter_closed_counts_as_stopped_closing(tmp_path: Path) -> None:
    adapter = open_raw(config(tmp_path / "device.img"))
    backend = backend_of(adapter)
    keys = make_keys(1)
    assert store(adapter, keys, [pattern(0, SIZE)]) == [True]
    io = backend._io

    def read_after_close(slot: int, buffer: memoryview) -> bytes:
        # The close begins between the load's closing check and its read, which then
        # meets the device closed under it.
        adapter.state.closing.set()
        raise OSError(errno.EBADF, "Bad file descriptor")

    io.read = read_after_close  # type: ignore[method-assign]
    buffer = memoryview(bytearray(SIZE))
    try:
        assert backend.get_many_into(keys, [buffer]) == [False]
        stats = adapter.stats()
        assert stats.get("load_stopped_closing") == 1
        assert not stats.get("slot_read_errors")
    finally:
        del io.read
        adapter.close()
