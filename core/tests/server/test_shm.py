"""Buffer conversion for the data plane and the client's segment mapping."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Arena
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import until_reachable
from lmcache_tiers.testing.threads import joined
from lmcache_tiers.tmpfs import is_tmpfs
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import (
    MappedSegment,
    SegmentMismatch,
    as_byte_array,
    as_writable_byte_array,
    segment_identity,
)


@pytest.mark.parametrize(
    "buffer",
    [
        b"\x01\x02\x03\x04",
        bytearray(b"\x01\x02\x03\x04"),
        memoryview(b"\x01\x02\x03\x04"),
        np.array([1, 2, 3, 4], dtype=np.uint8),
        np.array([[1, 2], [3, 4]], dtype=np.uint8),
        np.array([1, 2, 3, 4], dtype=np.uint8)[::1],
    ],
)
def test_byte_views_of_simple_buffers(buffer: object) -> None:
    assert as_byte_array(buffer).tobytes() == b"\x01\x02\x03\x04"


def test_typed_and_strided_arrays_keep_their_bytes() -> None:
    floats = np.arange(6, dtype=np.float32)
    assert as_byte_array(floats).tobytes() == floats.tobytes()
    strided = np.arange(12, dtype=np.int16)[::2]
    assert as_byte_array(strided).tobytes() == np.ascontiguousarray(strided).tobytes()
    view = memoryview(np.arange(8, dtype=np.int64))
    assert as_byte_array(view).tobytes() == np.arange(8, dtype=np.int64).tobytes()


def test_torch_tensors_including_bfloat16() -> None:
    tensor = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    raw = as_byte_array(tensor)
    assert raw.nbytes == 16
    assert torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.bfloat16).reshape(2, 4).equal(tensor)
    # no copy for a contiguous tensor: the view shares its memory
    raw[0:2] = 0
    assert tensor[0, 0].item() == 0.0
    assert as_byte_array(tensor.t()).nbytes == 16  # non-contiguous: copied, same size


def test_destinations_must_be_writable_and_contiguous() -> None:
    with pytest.raises(TypeError, match="read-only"):
        as_writable_byte_array(b"abc")
    with pytest.raises(TypeError, match="contiguous"):
        as_writable_byte_array(np.zeros(8, dtype=np.uint8)[::2])
    with pytest.raises(TypeError, match="contiguous"):
        as_writable_byte_array(torch.zeros(4, 4).t())
    target = torch.zeros(4, dtype=torch.float16)
    as_writable_byte_array(target)[:] = 0xFF
    assert torch.isnan(target).all()


def test_unsupported_objects_get_a_clear_error() -> None:
    with pytest.raises(TypeError, match="cannot store a str"):
        as_byte_array("text")


@pytest.fixture
def arena() -> Iterator[L1Arena]:
    with L1Arena(1 << 20, name=f"tiers_unit_{uuid.uuid4().hex[:10]}", prefault=False) as created:
        yield created


def test_mapping_sees_the_servers_bytes(arena: L1Arena) -> None:
    device, inode = segment_identity(arena.name)
    segment = MappedSegment(arena.name, arena.size, device, inode)
    arena.buffer[100:104] = b"abcd"
    assert bytes(segment.buffer[100:104]) == b"abcd"
    segment.array[200:202] = [7, 8]
    assert bytes(arena.buffer[200:202]) == b"\x07\x08"
    segment.check_slot(0, arena.size)
    with pytest.raises(ValueError):
        segment.check_slot(arena.size - 1, 2)
    segment.close()
    assert os.path.exists(arena.path), "a client must never unlink the server's segment"


def test_a_segment_with_another_identity_is_refused(arena: L1Arena) -> None:
    device, inode = segment_identity(arena.name)
    with pytest.raises(SegmentMismatch, match="not the server's segment"):
        MappedSegment(arena.name, arena.size, device, inode + 1)
    with pytest.raises(SegmentMismatch):
        MappedSegment(arena.name, arena.size * 2, device, inode)
    with pytest.raises(SegmentMismatch, match="cannot open"):
        MappedSegment("tiers_unit_missing", 4096, device, inode)


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", ".."])
def test_names_that_could_leave_dev_shm_are_refused(name: str) -> None:
    with pytest.raises(SegmentMismatch, match="refusing"):
        MappedSegment(name, 4096, 0, 0)


@pytest.mark.parametrize("directory", ["relative/dir", "/dev/shm/../etc", "/dev/shm/", "/dev//shm", "/a\0b"])
def test_directories_from_the_wire_must_be_absolute_and_normalized(directory: str) -> None:
    with pytest.raises(SegmentMismatch, match="refusing shared-memory directory"):
        MappedSegment("tiers_unit_x", 4096, 0, 0, directory=directory)


def test_an_empty_directory_means_dev_shm(arena: L1Arena) -> None:
    device, inode = segment_identity(arena.name)
    segment = MappedSegment(arena.name, arena.size, device, inode, directory="", populate=False)
    segment.close()


def test_only_a_regular_file_on_a_tmpfs_is_mapped(arena: L1Arena, tmp_path: Path) -> None:
    on_disk = tmp_path / "tiers_unit_disk"
    on_disk.write_bytes(bytes(4096))
    if is_tmpfs(str(on_disk)):
        pytest.skip("the test directory is itself on a tmpfs")
    st = os.stat(on_disk)
    with pytest.raises(SegmentMismatch, match="not a file on a tmpfs"):
        MappedSegment(on_disk.name, 4096, st.st_dev, st.st_ino, directory=str(tmp_path))
    # a link in a directory the server names, even to the real segment, is not followed
    link = tmp_path / "tiers_unit_link"
    link.symlink_to(arena.path)
    device, inode = segment_identity(arena.name)
    with pytest.raises(SegmentMismatch, match="cannot open"):
        MappedSegment(link.name, arena.size, device, inode, directory=str(tmp_path))


def test_generations_tell_which_slots_changed_hands() -> None:
    name = f"tiers_unit_{uuid.uuid4().hex[:10]}"
    with L1Arena(16 * 4096, name=name, prefault=False, generation_block=4096) as arena:
        assert (arena.size, arena.generation_offset, arena.segment_size) == (
            16 * 4096,
            16 * 4096,
            16 * 4096 + 16 * 8,
        )
        device, inode = segment_identity(arena.name)
        segment = MappedSegment(
            arena.name,
            arena.segment_size,
            device,
            inode,
            generation_offset=arena.generation_offset,
            generation_block=arena.generation_block,
        )
        try:
            assert segment.tracks_generations and segment.data_size == arena.size
            arena.generations[2] = 7  # the server gave the extent at 8192 back seven times
            slots = [p.Slot(0, 100, 0), p.Slot(8192, 5000, 7), p.Slot(p.NO_SLOT, 10, 3)]
            assert segment.changed(slots) == []
            arena.generations[2] += 1
            assert segment.changed(slots) == [1]
            with pytest.raises(ValueError, match="outside"):
                segment.check_slot(arena.size - 8, 16)  # the table is not object memory
            # no object is empty: a slot of none at the arena's end has no table entry
            with pytest.raises(ValueError, match="outside"):
                segment.check_slot(arena.size, 0)
        finally:
            segment.close()


def test_a_generation_table_that_does_not_fit_is_refused(arena: L1Arena) -> None:
    device, inode = segment_identity(arena.name)
    with pytest.raises(SegmentMismatch, match="does not fit"):
        MappedSegment(
            arena.name, arena.size, device, inode, generation_offset=arena.size - 8, generation_block=64
        )
    for offset, block in ((arena.size, 64), (arena.size - 4, 64), (0, 64), (arena.size // 2, 0), (-8, 64)):
        # a table described but not usable is refused, never mapped without its checks
        with pytest.raises(SegmentMismatch, match="generation table"):
            MappedSegment(
                arena.name, arena.size, device, inode, generation_offset=offset, generation_block=block
            )
    untracked = MappedSegment(arena.name, arena.size, device, inode)
    try:
        assert not untracked.tracks_generations
        assert untracked.changed([p.Slot(0, 1, 99)]) == []  # an old server: nothing to compare
    finally:
        untracked.close()


@pytest.mark.parametrize(("size", "offset", "block"), [(0, 0, 0), (1001, 8, 1), (4096 + 12, 4096, 4096)])
def test_a_segment_unmappable_as_described_is_a_mismatch(size: int, offset: int, block: int) -> None:
    """An empty segment file, or a table that does not end on a whole entry: refused as
    not the server's segment (the client goes inline), never another error from the
    middle of mapping it."""
    path = Path("/dev/shm") / f"tiers_unit_{uuid.uuid4().hex[:10]}"
    path.write_bytes(bytes(size))
    try:
        st = os.stat(path)
        with pytest.raises(SegmentMismatch):
            MappedSegment(
                path.name, size, st.st_dev, st.st_ino, generation_offset=offset, generation_block=block
            )
    finally:
        path.unlink()


def test_the_population_pass_is_over_before_the_last_user_unmaps(
    arena: L1Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close`` from another thread while a copy runs; that copy ends, and so unmaps,
    before the closing thread gets to stop the background pass: the pass must never go
    on advising the address range, which by then may be another mapping's."""
    from lmcache_tiers.wire import pagetables

    if pagetables._madvise is None:
        pytest.skip("no madvise through ctypes on this platform")
    monkeypatch.setattr(pagetables, "IDLE_S", 0.1)
    device, inode = segment_identity(arena.name)
    segment = MappedSegment(arena.name, arena.size, device, inode)
    real_madvise = pagetables._madvise
    after_unmap: list[int] = []

    def recording_madvise(address: int, length: int, advice: int) -> int:
        if segment._mmap.closed:
            after_unmap.append(address)
        return int(real_madvise(address, length, advice))

    monkeypatch.setattr(pagetables, "_madvise", recording_madvise)
    stopping = threading.Event()
    real_stop = segment.pages.stop

    def late_stop() -> None:
        if threading.current_thread().name == "closer":
            stopping.wait(5)  # the closing thread is descheduled here
        real_stop()

    monkeypatch.setattr(segment.pages, "stop", late_stop)
    closer = threading.Thread(target=segment.close, name="closer")
    with segment.in_use():
        closer.start()
        deadline = time.monotonic() + 5
        while not segment.closed:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert segment._mmap.closed  # the last user unmapped
    time.sleep(0.3)  # the client is idle: the pass would go on now
    stopping.set()
    closer.join(5)
    assert after_unmap == []


@pytest.mark.parametrize("operation", ["retrieve_into", "store"])
def test_offsets_of_a_restarted_server_never_go_to_the_old_mapping_when_another_thread_greets_it(
    make_server: Callable[..., TiersServer],
    restart_at_the_same_port: Callable[[TiersServer], TiersServer],
    operation: str,
) -> None:
    """The server restarts after this thread took the mapping for a request, and another
    thread of the same client greets the new server before this one looks at the reply:
    the reply's offsets are the new segment's, never read from (or written into) the old
    mapping."""
    first = make_server()
    client = Client(first.endpoint, timeout=5.0)
    try:
        assert client.uses_shm
        old = [ObjectKey("unit", 0, f"old-{index}".encode()) for index in range(4)]
        assert client.store(old, [bytes([0xAA]) * 8192] * 4) == 4
        client.release(old)
        key = ObjectKey("unit", 0, b"new-0")
        fresh = bytes(range(256)) * 32
        servers: list[TiersServer] = []
        real_call = client._call

        def restart_then_let_another_thread_greet(request: p._Request, *args: Any, **kwargs: Any) -> Any:
            if isinstance(request, (p.Retrieve, p.StoreReserve)) and not servers:
                servers.append(restart_at_the_same_port(first))
                with Client(servers[0].endpoint, timeout=5.0, shm=False) as writer:
                    if operation == "retrieve_into":
                        assert writer.store([key], [fresh]) == 1
                client._call = real_call  # type: ignore[method-assign]
                until_reachable(client)
                reply = real_call(request, *args, **kwargs)
                other = threading.Thread(target=client._follow_server, daemon=True)
                other.start()
                joined(other, "the client following the restarted server")
                return reply
            return real_call(request, *args, **kwargs)

        client._call = restart_then_let_another_thread_greet  # type: ignore[method-assign]
        if operation == "retrieve_into":
            target = bytearray(len(fresh))
            assert client.retrieve_into([key], [target]) == 1
            assert bytes(target) == fresh
        else:
            assert client.store([key], [fresh]) == 1
            with (
                Client(servers[0].endpoint, timeout=5.0, shm=False) as reader,
                reader.retrieve([key]) as views,
            ):
                assert [bytes(view) for view in views] == [fresh]
    finally:
        client.close()


def _store_and_read_back_as_another_user(endpoint: str, results: Any) -> None:
    """In a forked child: drop to the unprivileged ``nobody`` user, store and read back
    through a Client, and send what it saw (mapped or not, bytes, log lines) home."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("lmcache_tiers").addHandler(Collect())
    logging.getLogger("lmcache_tiers").setLevel(logging.INFO)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    key = ObjectKey("unit", 0, b"other-user")
    with Client(endpoint) as client:
        mapped = client._segment is not None
        client.store([key], [b"kv of another user" * 100])
        with client.retrieve([key]) as views:
            data = bytes(views[0])
    results.put((mapped, data, lines))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_client_of_another_user_cannot_map_the_segment_and_says_why(
    make_server: Callable[..., TiersServer],
) -> None:
    server = make_server()
    path = server.storage.l1.arena.path
    # A KV cache holds prompt-derived data: only the server's user may map it.
    assert os.stat(path).st_mode & 0o777 == 0o600
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_store_and_read_back_as_another_user, args=(server.endpoint, results))
    child.start()
    mapped, data, lines = results.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert not mapped
    assert data == b"kv of another user" * 100  # inline, through the socket
    assert any("Permission denied" in line and "inline" in line for line in lines), lines
