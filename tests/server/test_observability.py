"""HTTP /metrics, /healthz, /status and ``lmcache-tiers status`` against a live server."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiers_e2e import ServerProcess, fetch, make_keys, make_payloads, metric, start_server

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire.protocol import ErrorCode


def test_metrics_status_and_health(tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "server",
        adapters=[{"type": "mock", "max_size_gb": 0.5}],
        eviction_trigger_watermark=0.5,
        eviction_ratio=0.3,
    )
    try:
        keys, data = make_keys("metrics", 4), make_payloads("metrics", 4, 1 << 20)
        with Client(server.url) as client:
            client.store(keys, data)
            assert client.lookup(keys + make_keys("absent", 2)) == 4
            with client.retrieve(keys) as views:
                assert len(views) == 4
            with pytest.raises(ServerError) as failure:
                client.wait_prefetch(987654, 0.1)
            assert failure.value.code is ErrorCode.NOT_FOUND
            # push L1 (256 MiB) past its 50% watermark so the eviction controller runs
            filler = make_keys("filler", 40)
            client.store(filler, make_payloads("filler", 40, 4 << 20))

        status_code, content_type, text = fetch(f"{server.http_url}/metrics")
        assert status_code == 200 and content_type.startswith("text/plain")
        assert metric(text, "lmcache_tiers_lookups_total") == 1
        assert metric(text, "lmcache_tiers_lookup_hit_chunks_total", 'tier="l1"') == 4
        assert metric(text, "lmcache_tiers_lookup_hit_chunks_total", 'tier="l2"') == 0
        assert metric(text, "lmcache_tiers_store_chunks_total") == 44
        assert metric(text, "lmcache_tiers_bytes_total", 'direction="retrieve"') == 4 << 20
        assert metric(text, "lmcache_tiers_bytes_total", 'direction="store"') == (4 << 20) + 40 * (4 << 20)
        assert metric(text, "lmcache_tiers_failures_total", 'reason="not_found"') == 1
        assert metric(text, "lmcache_tiers_requests_total", 'frontend="0:native",op="Lookup"') == 1
        assert 0.0 < metric(text, "lmcache_tiers_l1_usage_ratio") <= 1.0
        assert metric(text, "lmcache_tiers_adapter_usage_ratio", 'adapter="0:mock"') >= 0.0
        assert metric(text, "lmcache_tiers_in_flight", 'kind="l2_prefetches"') == 0
        assert 'lmcache_tiers_in_flight{kind="l2_stores"}' in text
        assert metric(text, "lmcache_tiers_evictions_total", 'tier="l1"') > 0

        status_code, _, body = fetch(f"{server.http_url}/status")
        document = json.loads(body)
        assert status_code == 200
        assert document["server"]["endpoint"] == server.url
        assert document["server"]["shm_segment"] == server.shm_name
        assert document["l1"]["capacity_bytes"] == 1 << 28
        assert document["adapters"][0]["type"] == "mock"

        assert fetch(f"{server.http_url}/healthz")[:1] == (200,)
        assert fetch(f"{server.http_url}/nope")[0] == 404
    finally:
        assert server.stop() == 0, server.output()


def test_status_command_prints_a_table(server: ServerProcess) -> None:
    with Client(server.url) as client:
        client.store(make_keys("cli", 3), make_payloads("cli", 3, 4096))
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "status", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert server.url in result.stdout
    assert "L1" in result.stdout and "objects" in result.stdout

    as_json = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "status", "--url", server.url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(as_json.stdout)["l1"]["objects"] == 3


def test_status_command_reports_an_unreachable_server() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_tiers.cli.main",
            "status",
            "--url",
            "tcp://127.0.0.1:9",
            "--timeout",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "error:" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def rendered(document: dict[str, object]) -> str:
    """The tables ``lmcache-tiers status`` prints for ``document``, as plain text."""
    from rich.console import Console

    from lmcache_tiers.cli.commands_server import status_tables

    console = Console(width=200, record=True, file=io.StringIO())
    for table in status_tables(document):
        console.print(table)
    return console.export_text()


def test_status_renders_the_server_s_text_as_it_is_and_odd_numbers_as_unknown() -> None:
    """Adapter errors, names and failure reasons are the server's (and its plugins') text:
    a bracket in one is no rich markup, and a usage or size that is no number costs that
    cell -- neither may end the command half-printed with a traceback."""
    document = {
        "server": {"endpoints": ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:6555"], "draining": True},
        "adapters": [
            {"name": "0:fs", "error": "OSError: cannot open [/mnt/l2] [bold]x"},
            {"name": "1:own [b]", "usage": "half", "used_bytes": None, "backend": {}},
            {"name": "2:redis", "usage": 0.25, "used_bytes": 1 << 30, "backend": {"circuit_open": 1}},
        ],
        "failures": {"[/odd] reason": 1},
    }
    text = rendered(document)
    assert "tcp://127.0.0.1:5555, tcp://127.0.0.1:6555" in text
    assert "draining" in text
    assert "OSError: cannot open [/mnt/l2] [bold]x" in text
    assert "1:own [b]" in text
    assert "[/odd] reason" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") > 3}
    assert "?" in rows["0:fs"]  # its used bytes were not read: unknown, not an empty adapter
    assert rows["1:own [b]"].count("?") == 2
    assert "circuit open" in rows["2:redis"]
