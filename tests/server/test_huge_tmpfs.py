"""The L1 arena on a tmpfs mounted ``huge=always`` (``--shm-dir``): a server says it is on
huge pages, a client in another process learns the directory from HELLO, maps the
segment with huge pages (its own smaps says so) and moves exact bytes; clients that
predate the field, or look only in /dev/shm, fall back to inline bytes and stay correct.

Each test mounts a private tmpfs (root works here and in CI) and unmounts it after; where
mounting is refused the test is skipped with the system's reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from tiers_e2e import ServerProcess, fetch, make_keys, make_payloads, run_in_process, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.testing.mounts import tmpfs_at
from lmcache_tiers.tmpfs import pmd_mapped_bytes, shmem_override
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import MappedSegment, SegmentMismatch

MIB = 1 << 20
#: one request of the reference workload: 4 chunks of 8 MiB
CHUNK, CHUNKS = 8 * MIB, 4


@pytest.fixture
def huge_dir(tmp_path: Path) -> Iterator[str]:
    if shmem_override() == "deny":
        pytest.skip("shmem_enabled=deny: this system gives no tmpfs huge pages")
    directory = str(tmp_path / "huge")
    with tmpfs_at(directory, "size=160m,huge=always") as refused:
        if refused is not None:
            pytest.skip(refused)
        yield directory


@pytest.fixture
def huge_server(tmp_path: Path, huge_dir: str) -> Iterator[ServerProcess]:
    server = start_server(tmp_path / "server", l1_size_gb=0.125, l1_shm_dir=huge_dir)
    yield server
    code = server.stop()
    assert code == 0, server.output()
    assert not server.shm_path.exists(), "the L1 segment outlived the server"


def job_store_retrieve_huge(url: str, tag: str) -> dict[str, object]:
    """Store one request, read it back, and say how this process's mapping is paged."""
    keys, payloads = make_keys(tag, CHUNKS), make_payloads(tag, CHUNKS, CHUNK)
    with Client(url, timeout=30) as client:
        segment = client._segment
        assert segment is not None, "the client did not map the segment"
        stored = client.store(keys, payloads)
        targets = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(CHUNKS)]
        retrieved = client.retrieve_into(keys, targets)
        equal = all(np.array_equal(a, b) for a, b in zip(payloads, targets, strict=True))
        address = segment.array.ctypes.data
        return {
            "stored": stored,
            "retrieved": retrieved,
            "equal": equal,
            "shm_dir": client.server.shm_dir,
            "aligned": address % (2 * MIB) == 0,
            "pmd_mapped": pmd_mapped_bytes(address, segment.size),
        }


def test_a_client_in_another_process_maps_huge_pages_and_moves_exact_bytes(
    huge_server: ServerProcess, huge_dir: str
) -> None:
    assert huge_server.shm_path.parent == Path(huge_dir) and huge_server.shm_path.exists()
    result = run_in_process(job_store_retrieve_huge, huge_server.url, "huge")
    assert result["stored"] == CHUNKS and result["retrieved"] == CHUNKS and result["equal"], result
    assert result["shm_dir"] == huge_dir and result["aligned"], result
    pmd_mapped = result["pmd_mapped"]
    # every page the request touched (32 MiB, written and read back) is a huge one
    assert isinstance(pmd_mapped, int) and pmd_mapped >= CHUNKS * CHUNK, result
    assert huge_server.http_url is not None
    status, _, body = fetch(f"{huge_server.http_url}/status")
    assert status == 200
    pages = json.loads(body)["server"]["l1_pages"]
    assert pages["huge_pages"] is True and pages["tmpfs_huge"] == "always", pages
    assert pages["directory"] == huge_dir and pages["hint"] is None
    assert "huge pages (tmpfs huge=always)" in huge_server.output()


#: HelloReply as clients older than ``shm_dir`` decode it: every field before that one
_HelloBeforeShmDir = msgspec.defstruct(
    "HelloBeforeShmDir",
    [
        (
            info.name,
            info.type,
            info.default
            if info.default is not msgspec.NODEFAULT
            else msgspec.field(default_factory=info.default_factory),
        )
        for info in msgspec.structs.fields(p.HelloReply)
        if info.name != "shm_dir"
    ],
    array_like=True,
    gc=False,
    tag_field="op",
    tag=p.Op.HELLO.value,
)


def job_old_client(url: str, tag: str) -> tuple[bool, bool, bool]:
    """What a client that predates ``shm_dir`` does: decode HELLO without the field, look
    for the segment in /dev/shm, and fall back to inline bytes when it is not there."""
    with Client(url, timeout=30) as probe:
        old = msgspec.msgpack.decode(p.encode(probe.server), type=_HelloBeforeShmDir)
    try:
        MappedSegment(old.shm_name, old.shm_size, old.shm_device, old.shm_inode, populate=False)
        found_in_dev_shm = True
    except SegmentMismatch:
        found_in_dev_shm = False
    keys, payloads = make_keys(tag, 2), make_payloads(tag, 2, MIB)
    with Client(url, shm=False, timeout=30) as client:  # inline, as the old client now is
        stored = client.store(keys, payloads)
        with client.retrieve(keys) as views:
            equal = [bytes(view) for view in views] == [payload.tobytes() for payload in payloads]
    return found_in_dev_shm, stored == 2, equal


def test_clients_that_only_know_dev_shm_fall_back_to_inline_bytes(huge_server: ServerProcess) -> None:
    found_in_dev_shm, stored, equal = run_in_process(job_old_client, huge_server.url, "old")
    assert not found_in_dev_shm and stored and equal


def test_a_hello_without_the_field_means_dev_shm() -> None:
    old_server = msgspec.msgpack.encode(_HelloBeforeShmDir(1, shm_name="x", shm_size=1))
    reply = p.reply_decoder.decode(old_server)
    assert isinstance(reply, p.HelloReply) and reply.shm_dir == ""


def test_the_default_directory_is_announced_as_before(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", l1_size_gb=0.0625)
    try:
        with Client(server.url, timeout=30) as client:
            assert client.server.shm_dir == "" and client.uses_shm
        _, _, body = fetch(f"{server.http_url}/status")
        pages = json.loads(body)["server"]["l1_pages"]
        assert pages["directory"] == "/dev/shm"
        if not pages["huge_pages"]:
            assert "--shm-dir" in pages["hint"] and "--shm-dir" in server.output()
    finally:
        assert server.stop() == 0, server.output()
