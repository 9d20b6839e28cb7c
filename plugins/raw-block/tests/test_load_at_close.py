"""A load still running when the adapter closes (core gave up on it at its call timeout and
closed) finishes with its I/O staging blocks intact: close releases them only once no
call uses them.  It ends as a load, hit or miss, never as the error of a released buffer."""

from __future__ import annotations

import threading
from pathlib import Path

from rb_helpers import backend_of, config, open_raw, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 9000
WAIT_S = 30.0


def test_a_load_paused_on_its_staging_block_finishes_across_the_close(tmp_path: Path) -> None:
    adapter = open_raw(config(tmp_path / "device.img"))
    backend = backend_of(adapter)
    keys = make_keys(1)
    assert store(adapter, keys, [pattern(0, SIZE)]) == [True]
    in_flight = backend._device.in_flight
    staging = backend._io._staging
    header = staging.header
    paused, closing, io_closed = threading.Event(), threading.Event(), threading.Event()
    armed = [True]

    def header_then_pause() -> memoryview:
        block = header()
        if armed[0]:
            armed[0] = False
            paused.set()
            assert closing.wait(WAIT_S)
            if not in_flight._count:
                # The load is not counted in flight: nothing keeps close from releasing the
                # block it holds, which it does before the load goes on.
                assert io_closed.wait(WAIT_S)
        return block

    staging.header = header_then_pause  # type: ignore[method-assign]
    drain, close_io = in_flight.drain, backend._io.close

    def drain_once_closing(timeout_s: float) -> bool:
        closing.set()
        return drain(timeout_s)

    def close_io_then_say() -> None:
        close_io()
        io_closed.set()

    in_flight.drain = drain_once_closing  # type: ignore[method-assign]
    backend._io.close = close_io_then_say  # type: ignore[method-assign]
    outcome: list[object] = []
    buffer = memoryview(bytearray(SIZE))

    def load() -> None:
        try:
            outcome.extend(backend.get_many_into(keys, [buffer]))
        except BaseException as exc:
            outcome.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    assert paused.wait(WAIT_S)
    adapter.close()
    loader.join(WAIT_S)
    assert not loader.is_alive()
    # Admitted before the close, it read its slot: a hit with the bytes stored.
    assert outcome == [True]
    assert bytes(buffer) == pattern(0, SIZE)
    assert io_closed.is_set()
