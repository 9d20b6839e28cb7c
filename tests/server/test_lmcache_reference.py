"""LMCache's own client against ``lmcache-tiers serve --frontend lmcache_mp``.

The reference package lives in a venv of its own (``LMCACHE_REF_VENV``; scripts/test.sh
installs ``lmcache==0.5.6`` into the default location before the suite runs).  Its
``lmcache bench server --mode cpu`` stores 8 requests of 1024 tokens, looks them up again,
retrieves them and compares checksums of the KV bytes; LMCache's shared-memory transfer
code stores chunks that the native client then reads back.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import HERE, ServerProcess, fetch, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.plugin import kv_rank_of
from lmcache_tiers.testing.ports import free_ports

CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
REF_VENV = Path(os.environ.get("LMCACHE_REF_VENV", CACHE_HOME / "lmcache-tiers" / "lmcache-0.5.6"))
REF_ENV = {"DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
SHAPE_SPEC = "(2,256,16,8,128):bfloat16:8"  # 8 MiB chunks, 32 MiB per request
#: 1024 tokens per request in chunks of 256
CHUNKS_PER_REQUEST = 4

ROOT = HERE.parents[1]


@pytest.fixture(scope="module", autouse=True)
def reference_installed() -> None:
    """scripts/test.sh installs the reference before the suite; a run without it installs
    it here (the same script), and skips only when that cannot be done."""
    if not (REF_VENV / "bin" / "lmcache").exists():
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "install_reference_lmcache.sh")],
            env={**os.environ, "LMCACHE_REF_VENV": str(REF_VENV)},
            capture_output=True,
            timeout=1800,
        )
    if not (REF_VENV / "bin" / "lmcache").exists():
        pytest.skip(
            f"the reference LMCache cannot be installed into {REF_VENV} "
            "(scripts/install_reference_lmcache.sh needs the package index; LMCACHE_REF_VENV moves it)"
        )


def run_bench(
    url: str,
    output: Path,
    interval: float = 0.0,
    shape: str = SHAPE_SPEC,
    requests: int = 8,
    paced_by: str | None = None,
) -> dict[str, Any]:
    """LMCache's bench; with ``paced_by`` (a /status URL) its pauses last until the server
    has put away what it wrote, ``interval`` at most (lmcache_ref_bench_paced.py)."""
    bench = [str(REF_VENV / "bin" / "lmcache")]
    if paced_by is not None:
        bench = [str(REF_VENV / "bin" / "python"), str(HERE / "lmcache_ref_bench_paced.py"), paced_by]
    command = [
        *bench,
        *("bench", "server", "--rpc-url", url, "--mode", "cpu", "--interval", str(interval)),
        *("--start", "0", "--end", str(requests), "--num-tokens", "1024", "--kvcache-shape-spec", shape),
        *("--format", "json", "--output", str(output)),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, env={**os.environ, **REF_ENV}, cwd=output.parent
    )
    assert done.returncode == 0 and output.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    metrics: dict[str, Any] = json.loads(output.read_text())["metrics"]
    return metrics


def serve(tmp_path: Path, **options: Any) -> tuple[ServerProcess, str]:
    """A server with the LMCache front end on --port and the native one beside it."""
    port, metrics_port, native_port = free_ports(3)  # together: never one port twice
    server = start_server(
        tmp_path / "server",
        port=port,
        metrics_port=metrics_port,
        l1_size_gb=0.5,
        frontends=[{"type": "lmcache_mp"}, {"type": "native", "port": native_port}],
        **options,
    )
    return server, f"tcp://127.0.0.1:{native_port}"


def stop(server: ServerProcess) -> None:
    assert server.stop() == 0, server.output()
    assert not server.shm_path.exists()


def assert_every_checksum_passed(metrics: dict[str, Any], requests: int = 8) -> None:
    results = metrics["results"]
    counts = (results["total_requests"], results["checksum_ok"], results["checksum_fail"])
    assert counts == (requests, requests, 0), metrics


def test_reference_bench_passes_every_checksum(tmp_path: Path) -> None:
    server, _ = serve(tmp_path)
    try:
        metrics = run_bench(server.url, tmp_path / "l1.json")
        assert_every_checksum_passed(metrics)
        status = json.loads(fetch(f"{server.http_url}/status")[2])
        mp = next(entry for entry in status["frontends"] if entry["type"] == "lmcache_mp")
        assert (mp["store_chunks"], mp["retrieve_chunks"]) == (32, 32)
        assert status["failures"] == {} and mp["failures"] == {}
    finally:
        stop(server)


def test_reference_bench_with_the_warm_pass_served_from_l2(tmp_path: Path) -> None:
    """skip_l1 takes every chunk out of L1 once it is in L2, so with a pause between the
    cold and the warm pass of a request, every warm chunk is loaded from the NIXL files.

    The bench pauses twice per request (after the cold and after the warm pass), each
    pause lasting until the server has put the chunks away: three requests -- the second
    and third stored while L2 holds the earlier ones -- check what eight would."""
    requests = 3
    params = {"file_path": str(tmp_path / "l2"), "use_direct_io": "false", "max_capacity_gb": "1"}
    adapter = {"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": params}
    server, _ = serve(tmp_path, adapters=[adapter], l2_store_policy="skip_l1")
    try:
        # The pause must outlast a request's L2 store and skip_l1's removal from L1 (a
        # fixed 1 s left 4 of 32 chunks in L1 on a two-core machine busy with other
        # tests): each lasts until /status shows both done, 60 s at most.
        metrics = run_bench(
            server.url,
            tmp_path / "l2.json",
            interval=60,
            requests=requests,
            paced_by=f"{server.http_url}/status",
        )
        assert_every_checksum_passed(metrics, requests)
        status = json.loads(fetch(f"{server.http_url}/status")[2])
        assert status["requests"]["l2_hit_chunks"] == requests * CHUNKS_PER_REQUEST, status["requests"]
        assert status["adapters"][0]["keys_stored"] == requests * CHUNKS_PER_REQUEST
        assert status["failures"] == {}
    finally:
        stop(server)


def test_chunks_stored_by_lmcache_code_are_read_by_the_native_client(tmp_path: Path) -> None:
    model = "meta-llama/Llama-3.1-8B"
    server, native = serve(tmp_path, metrics=False)
    try:
        done = subprocess.run(
            [str(REF_VENV / "bin" / "python"), str(HERE / "lmcache_ref_store.py"), server.url, model],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **REF_ENV},
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        written = json.loads(done.stdout.strip().splitlines()[-1])
        assert written["stored"] is True
        keys = prefix_keys([7] + [9906] * 512, 256, model_name=model, kv_rank=kv_rank_of(1, 0))
        with Client(native) as reader:
            assert reader.lookup(keys) == 2
            with reader.retrieve(keys) as views:
                assert [hashlib.sha256(view).hexdigest() for view in views] == written["digests"]
            reader.release(keys)
    finally:
        stop(server)
