"""Two real servers with different serde chains sharing one L2 (Redis, S3 on SeaweedFS, a
Mooncake Store pool) at the same time, as docs/deploy/shared-l2.md warns against: both
store the same prompt, one after the other, and read it back.  A record of the other chain
(or of another aesgcm key) is a miss counted on the reader, and never its encoded bytes
handed out as the chunk; chains that differ only in a serde's options read each other's
records with their bytes -- a key one server stored and the other stored again, of
another size, too."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shared_stores import STARTERS, SharedStore
from tiers_e2e import ServerProcess, digest, fetch, make_keys, metric, start_server

from lmcache_tiers.client import Client

_NEEDED = ("lmcache_plugin_serde_zstd", "lmcache_plugin_serde_aesgcm")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.skip(f"not installed: {', '.join(_missing)}", allow_module_level=True)

CHUNK = 64 << 10
COUNT = 6
#: a bound against hangs only; nothing asserts on timing
HANG_GUARD_S = 60.0

STORES = STARTERS
#: the adapter field naming each test's own part of the store
NAMESPACE_FIELD = {"mooncake": "key_prefix", "redis": "key_prefix", "s3": "prefix"}
NAMESPACE_END = {"mooncake": "/", "redis": ":", "s3": "/"}


@pytest.fixture(scope="module", params=sorted(STORES))
def store_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SharedStore]]:
    """One Redis or SeaweedFS for the module's tests; each test works under a namespace of
    its own in it."""
    with ExitStack() as stack:
        yield request.param, STORES[request.param](tmp_path_factory.mktemp(request.param), stack)


def _key_file(directory: Path, name: str) -> str:
    path = directory / name
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def _chains(case: str, directory: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if case == "zstd_and_none":
        return [{"type": "zstd"}], []
    if case == "aesgcm_two_keys":
        first, second = _key_file(directory, "first.key"), _key_file(directory, "second.key")
        return [{"type": "aesgcm", "key_file": first}], [{"type": "aesgcm", "key_file": second}]
    if case == "zstd_aesgcm_reordered":
        key = _key_file(directory, "shared.key")
        aesgcm = {"type": "aesgcm", "key_file": key}
        return [{"type": "zstd"}, aesgcm], [aesgcm, {"type": "zstd"}]
    assert case == "zstd_levels"
    return [{"type": "zstd", "level": 1}], [{"type": "zstd", "level": 19}]


#: the counter a reader of the other server's records raises, per case (None: it reads them)
MISS_COUNTER = {
    "zstd_and_none": "serde_chain_mismatch",
    "aesgcm_two_keys": "serde_aesgcm_wrong_key",
    "zstd_aesgcm_reordered": "serde_chain_mismatch",
    "zstd_levels": None,
}


@functools.cache  # made for every store and every check of a read: the same few prompts
def prompt_chunks(tag: str) -> list[np.ndarray[Any, Any]]:
    """The prompt ``tag``'s chunks: words of a small random vocabulary, which zstd's levels
    compress to different sizes (random bytes it stores as they are, at one size)."""
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    vocabulary = [rng.integers(0, 256, int(rng.integers(3, 12)), dtype=np.uint8) for _ in range(64)]
    chunks = []
    for _ in range(COUNT):
        words = np.concatenate([vocabulary[i] for i in rng.integers(0, len(vocabulary), CHUNK // 3)])
        chunks.append(words[:CHUNK].copy())
    return chunks


class Node:
    def __init__(self, server: ServerProcess, adapter_name: str) -> None:
        self.server, self.adapter_name = server, adapter_name

    def store_through_l2(self, tag: str) -> None:
        """Store the prompt ``tag``, wait until L2 holds it, then empty L1 so reads come from L2."""
        with Client(self.server.url, timeout=HANG_GUARD_S) as client:
            before = int(client.status()["adapters"][0]["keys_stored"])
            client.store(make_keys(tag, COUNT), prompt_chunks(tag))
            deadline = time.monotonic() + HANG_GUARD_S
            while int(client.status()["adapters"][0]["keys_stored"]) < before + COUNT:
                assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
                time.sleep(0.05)
            client.clear()

    def read_checked(self, tag: str) -> int:
        """Look up and retrieve the prompt ``tag``; fail on any wrong byte; return the hits."""
        keys = make_keys(tag, COUNT)
        with Client(self.server.url, timeout=HANG_GUARD_S) as client:
            hits = client.lookup(keys)
            with client.retrieve(keys[:hits]) as views:
                got = digest(views)
            client.clear()
        assert got == digest(prompt_chunks(tag))[:hits], f"wrong bytes for {tag!r}"
        return hits

    def stat(self, name: str) -> float:
        assert self.server.http_url is not None
        _, _, text = fetch(self.server.http_url + "/metrics")
        sample = f'lmcache_tiers_adapter_stat{{adapter="{self.adapter_name}",stat="{name}"}} '
        # A stat an adapter never raised is not exported.
        return metric(text, sample.rstrip()) if sample in text else 0.0

    def log(self) -> str:
        return (self.server.log_dir / "stderr.txt").read_text(errors="replace")


@contextmanager
def pair(case: str, tmp_path: Path, store_service: tuple[str, SharedStore]) -> Iterator[tuple[Node, Node]]:
    """Two servers on one namespace of the shared store, each with its chain of ``case``."""
    kind, (adapter, env) = store_service
    namespace = {NAMESPACE_FIELD[kind]: f"chains-{uuid.uuid4().hex[:8]}{NAMESPACE_END[kind]}"}
    nodes: list[Node] = []
    # Both start, and later stop, at the same time: neither waits on the other for that.
    with ThreadPoolExecutor(2) as pool:
        try:
            starts = [
                pool.submit(
                    start_server,
                    tmp_path / name,
                    adapters=[{**adapter, **namespace, "serde": chain}],
                    env=env,
                )
                for name, chain in zip(("first", "second"), _chains(case, tmp_path), strict=True)
            ]
            wait(starts)
            nodes.extend(
                Node(start.result(), f"0:{adapter['type']}") for start in starts if not start.exception()
            )
            for start in starts:
                start.result()  # a server that did not start fails the test (the other is stopped)
            yield nodes[0], nodes[1]
        finally:
            stops = [(node, pool.submit(node.server.stop)) for node in nodes]
            for node, stop in stops:
                assert stop.result() == 0, node.server.output()


@pytest.mark.parametrize("case", sorted(MISS_COUNTER))
def test_each_server_reads_its_own_records_and_never_the_other_chains(
    case: str, tmp_path: Path, store_service: tuple[str, SharedStore]
) -> None:
    counter = MISS_COUNTER[case]
    with pair(case, tmp_path, store_service) as (first, second):
        first.store_through_l2("prompt")
        if counter is None:
            assert second.read_checked("prompt") == COUNT, "chains differing in options only read each other"
            # Each stores the prompt again, replacing the other's records with records of
            # another size than the other accounts: each reads them all the same.
            second.store_through_l2("prompt")
            assert first.read_checked("prompt") == COUNT
            first.store_through_l2("prompt")
            assert second.read_checked("prompt") == COUNT
            second.store_through_l2("other")
            assert first.read_checked("other") == COUNT
            for node in (first, second):
                assert node.stat("lookup_size_unknown") == 0, node.log()
            return
        assert second.read_checked("prompt") == 0, "the other chain's records must be misses"
        assert second.stat(counter) >= 1, second.log()
        # The second server stores the same prompt (same keys, same bytes): its records
        # replace the first's in the shared store, and now the first server misses.
        second.store_through_l2("prompt")
        assert second.read_checked("prompt") == COUNT
        assert first.read_checked("prompt") == 0
        assert first.stat(counter) >= 1, first.log()
        # A prompt only the second server stored is a miss for the first as well.
        second.store_through_l2("other")
        assert first.read_checked("other") == 0
        assert second.read_checked("other") == COUNT
        for node in (first, second):
            assert node.stat("corrupt_records_removed") == 0, "another chain's record is not damage"
