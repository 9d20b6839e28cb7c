"""dax stores a group of objects in two rounds: every payload copied into its slot (on
the store workers), then every header written, committed and published.  Each object
still succeeds or fails alone, and nothing is committed before its bytes are in place."""

from __future__ import annotations

import errno

import pytest
from dax_helpers import backend_of, client, load, open_dax, shm_dir, size_gb
from lmcache_plugin_dax import DaxConfig
from lmcache_plugin_dax.backend import PARALLEL_STORE_PIECE, DaxBackend
from lmcache_plugin_raw_block.slots import Claim

from lmcache_tiers.testing.l2 import make_keys, pattern

BIG_SLOT = 2 * PARALLEL_STORE_PIECE + 4096


def big_config(path: str, slots: int = 6, **extra: object) -> DaxConfig:
    return DaxConfig(device_path=path, max_dax_size_gb=size_gb(slots, BIG_SLOT), slot_bytes=BIG_SLOT, **extra)


def big_data(count: int, seed: int = 0) -> list[bytes]:
    # several pieces each, the last one partial, and sizes differing per object
    return [pattern(seed * 100 + i, BIG_SLOT - 1000 * (i + 1)) for i in range(count)]


def test_a_group_copied_on_two_workers_loads_back_and_survives_a_restart() -> None:
    with shm_dir() as directory:
        cfg = big_config(str(directory / "dax.img"), num_store_workers=2)
        keys, data = make_keys(4), big_data(4)
        adapter = open_dax(cfg)
        try:
            assert cfg.store_workers == 2
            assert client(adapter).store(keys, [memoryview(bytearray(d)) for d in data]) == [True] * 4
            assert load(adapter, keys, [len(d) for d in data]) == ([True] * 4, data)
        finally:
            adapter.close()
        reopened = open_dax(cfg)
        try:
            assert reopened.stats()["recovered_objects"] == 4
            assert load(reopened, keys, [len(d) for d in data]) == ([True] * 4, data)
        finally:
            reopened.close()


@pytest.mark.parametrize(("code", "reusable"), [(errno.EIO, False), (errno.ENOSPC, True)])
def test_a_copy_that_fails_fails_its_own_object_only(
    monkeypatch: pytest.MonkeyPatch, code: int, reusable: bool
) -> None:
    with shm_dir() as directory:
        adapter = open_dax(big_config(str(directory / "dax.img"), num_store_workers=2))
        backend = backend_of(adapter)
        copy = DaxBackend._copy_payload
        failing: list[int] = []

        def copy_failing_once(self: DaxBackend, claim: Claim, payload: memoryview) -> bytes:
            if not failing and payload.nbytes == len(data[1]):
                failing.append(claim.slot)
                raise OSError(code, "injected")
            return copy(self, claim, payload)

        monkeypatch.setattr(DaxBackend, "_copy_payload", copy_failing_once)
        keys, data = make_keys(3), big_data(3)
        try:
            assert client(adapter).store(keys, [memoryview(bytearray(d)) for d in data]) == [
                True,
                False,
                True,
            ]
            assert adapter.stats()["slot_write_errors"] == 1
            region, local = backend._place(failing[0])
            assert int(region.commits[local]) == 0
            assert backend.table.quarantined_slots == (0 if reusable else 1)
            assert backend.table.used_slots == 2 + (0 if reusable else 1)
            found = client(adapter).lookup_and_lock(keys).found
            adapter.unlock([key for key, hit in zip(keys, found, strict=True) if hit])
            assert found == [True, False, True]
            # The failed key stores fine once the copy works again.
            assert client(adapter).store(keys[1:2], [memoryview(bytearray(data[1]))]) == [True]
            assert load(adapter, keys, [len(d) for d in data]) == ([True] * 3, data)
        finally:
            adapter.close()


def test_an_interrupted_copy_round_settles_every_claim_and_commits_nothing_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with shm_dir() as directory:
        cfg = big_config(str(directory / "dax.img"), num_store_workers=2)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        copy = DaxBackend._copy_payload

        def interrupted(self: DaxBackend, claim: Claim, payload: memoryview) -> bytes:
            if payload.nbytes == len(data[0]):
                raise KeyboardInterrupt
            return copy(self, claim, payload)

        monkeypatch.setattr(DaxBackend, "_copy_payload", interrupted)
        keys, data = make_keys(3), big_data(3)
        try:
            with pytest.raises(KeyboardInterrupt):
                backend.put_many(keys, [memoryview(bytearray(d)) for d in data])
            # The other two were settled (stored), the interrupted one given back.
            assert backend.table.used_slots == 2
            assert [entry is not None for entry in backend.table.lookup(keys)] == [False, True, True]
            committed = sum(int(region.commits[:].astype(bool).sum()) for region in backend.regions)
            assert committed == 2
        finally:
            adapter.close()
        monkeypatch.undo()
        reopened = open_dax(cfg)
        try:
            assert reopened.stats()["recovered_objects"] == 2
            assert load(reopened, keys[1:], [len(d) for d in data[1:]]) == ([True] * 2, data[1:])
        finally:
            reopened.close()


def test_small_groups_are_copied_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    with shm_dir() as directory:
        adapter = open_dax(big_config(str(directory / "dax.img"), num_store_workers=2))
        backend = backend_of(adapter)
        calls: list[bool] = []
        mapped = backend._writers.map

        def spy(work: object, *columns: object, parallel: bool = True) -> object:
            calls.append(parallel)
            return mapped(work, *columns, parallel=parallel)  # type: ignore[arg-type]

        monkeypatch.setattr(backend._writers, "map", spy)
        try:
            small = [pattern(i, 4096) for i in range(3)]
            assert backend.put_many(make_keys(3), [memoryview(bytearray(d)) for d in small]) == [True] * 3
            big = big_data(2, seed=1)
            assert (
                backend.put_many(make_keys(2, start=10), [memoryview(bytearray(d)) for d in big])
                == [True] * 2
            )
            # (copies, headers) per group: small copies stay on this thread, large ones spread
            assert calls == [False, False, True, False]
        finally:
            adapter.close()
