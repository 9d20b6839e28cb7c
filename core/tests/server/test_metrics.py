"""/metrics and the HTTP endpoint: a valid exposition, every counter exported, and a
broken adapter, method or client costing one sample or one answer, never the scrape."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmcache_tiers.client import Client
from lmcache_tiers.controllers.stats import ADAPTER_COUNTERS
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.server.http import HttpEndpoint
from lmcache_tiers.server.metrics import MAX_EXPORTED_STATS, build_registry, render
from lmcache_tiers.testing.http_endpoints import counting_endpoint, port_of
from lmcache_tiers.testing.ports import free_port

Factory = Callable[..., TiersServer]

MOCK_ADAPTER = json.dumps({"type": "mock", "max_size_gb": 0.1})
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def scrape(server: TiersServer) -> str:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and labels; the exposition checked strictly
    on the way: one family per name, valid names, counters and gauges finite."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        assert family.name not in families, f"{family.name} emitted twice"
        families.add(family.name)
        assert METRIC_NAME.fullmatch(family.name), family.name
        for sample in family.samples:
            assert math.isfinite(sample.value), sample
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in found, f"{key} emitted twice"
            found[key] = sample.value
    return found


@pytest.fixture
def with_adapter(make_server: Factory) -> TiersServer:
    server = make_server(adapters=[MOCK_ADAPTER], metrics_port=free_port())
    key = ObjectKey("unit", 0, b"metrics")
    with Client(server.endpoint) as client:
        client.store([key], [b"x" * 5000])
        assert client.lookup([key]) == 1
        client.release([key])
    return server


def test_the_exposition_is_valid(with_adapter: TiersServer) -> None:
    found = samples(scrape(with_adapter))
    assert found[("lmcache_tiers_adapter_status_error", (("adapter", "0:mock"),))] == 0.0
    assert found[("lmcache_tiers_keys_written_total", ())] == 1.0


def test_an_adapter_whose_stats_raise_is_counted_and_left_out_not_zeroed(
    with_adapter: TiersServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = with_adapter.storage._parts.slots[0].adapter

    def unreachable() -> float:
        raise ConnectionError("backend unreachable")

    monkeypatch.setattr(adapter, "usage", unreachable)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        found = samples(scrape(with_adapter))
    mock = (("adapter", "0:mock"),)
    # A zero would be a counter reset, and -1 would say "no capacity": neither is true.
    assert ("lmcache_tiers_adapter_backend_errors_total", mock) not in found
    assert ("lmcache_tiers_adapter_usage_ratio", mock) not in found
    assert found[("lmcache_tiers_adapter_status_error", mock)] == 1.0
    assert found[("lmcache_tiers_failures_total", (("reason", "l2_status_error"),))] >= 1.0
    assert ("lmcache_tiers_adapter_store_tasks_submitted_total", mock) in found  # the engine still counts
    assert "0:mock: its usage or stats could not be read: ConnectionError" in caplog.text


def test_every_counter_of_the_status_reaches_metrics(with_adapter: TiersServer) -> None:
    """Each counter the storage keeps, set to a value of its own, is found in /metrics."""
    document = with_adapter.storage_status()
    values = iter(range(1001, 10_000))
    counters = {
        "requests": list(document["requests"]),
        "store": ["l1_deleted_after_store", "skipped_gone"],
    }
    expected: dict[str, int] = {}
    for section, names in counters.items():
        for name in names:
            document[section][name] = expected[f"{section}.{name}"] = next(values)
    for name in ("evicted_keys", "evicted_bytes", "runs"):
        document["eviction"]["l1"][name] = expected[f"eviction.l1.{name}"] = next(values)
    for name in ADAPTER_COUNTERS:
        document["adapters"][0][name] = expected[f"adapter.{name}"] = next(values)
    document["eviction"]["l2"]["0:mock"] = document["adapters"][0]["keys_evicted"]
    for name in document["l1"]["leases"]:
        document["l1"]["leases"][name] = expected[f"leases.{name}"] = next(values)

    text = render(build_registry(lambda: [], lambda: document)).decode()
    exported = set(samples(text).values())
    missing = sorted(name for name, value in expected.items() if value not in exported)
    assert not missing, f"counted but not in /metrics: {missing}"


def collector_text(adapter: dict[str, Any]) -> str:
    storage = {"adapters": [adapter], "failures": {}}
    return render(build_registry(lambda: [("0:native", FrontendStats())], lambda: storage)).decode()


def test_a_stat_that_is_not_a_number_costs_that_stat_only(caplog: pytest.LogCaptureFixture) -> None:
    adapter = {"index": 0, "name": "0:custom", "type": "custom", "usage": 0.5, "used_bytes": 10}
    adapter["backend"] = {"objects": 3, "mode": "read-write", "backend_errors": 2}
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        found = samples(collector_text(adapter))
    custom = (("adapter", "0:custom"),)
    assert found[("lmcache_tiers_adapter_stat", (("adapter", "0:custom"), ("stat", "objects")))] == 3.0
    assert found[("lmcache_tiers_adapter_backend_errors_total", custom)] == 2.0
    assert found[("lmcache_tiers_failures_total", (("reason", "metrics_stat_not_a_number"),))] == 1.0
    assert "0:custom: stat 'mode' is not a number" in caplog.text


def test_a_stat_that_is_not_finite_costs_that_stat_only(caplog: pytest.LogCaptureFixture) -> None:
    """NaN and infinities are numbers to Python but no value of a counter or gauge: a
    backend answering one must not put it in the exposition, nor fail the scrape."""
    adapter = {"index": 0, "name": "0:custom", "type": "custom", "usage": float("nan"), "used_bytes": None}
    adapter["backend"] = {"objects": 3, "latency_ms": math.nan, "backend_errors": math.inf, "big": 10**400}
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        found = samples(collector_text(adapter))
    custom = (("adapter", "0:custom"),)
    assert found[("lmcache_tiers_adapter_stat", (("adapter", "0:custom"), ("stat", "objects")))] == 3.0
    assert ("lmcache_tiers_adapter_usage_ratio", custom) not in found
    assert ("lmcache_tiers_adapter_used_bytes", custom) not in found
    assert found[("lmcache_tiers_failures_total", (("reason", "metrics_stat_not_a_number"),))] == 5.0
    assert "0:custom: stat 'latency_ms' is not a number (nan)" in caplog.text


@pytest.mark.parametrize("stats", [None, ["objects", 3], "objects=3"])
def test_stats_that_are_not_a_mapping_cost_that_adapter_s_stats_only(
    stats: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An adapter a plugin builds whole answers ``stats()`` itself: an answer that is no
    mapping of stats is left out and counted, and the scrape still carries the rest."""
    name = f"0:{type(stats).__name__}"  # one per case: the warning is logged once per burst
    adapter = {"index": 0, "name": name, "type": "custom", "usage": 0.5, "used_bytes": 10, "backend": stats}
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        found = samples(collector_text(adapter))
    custom = (("adapter", name),)
    assert found[("lmcache_tiers_adapter_usage_ratio", custom)] == 0.5
    assert ("lmcache_tiers_adapter_backend_errors_total", custom) not in found
    # its stats are left out as for one whose stats() raised, and said so the same way
    assert found[("lmcache_tiers_adapter_status_error", custom)] == 1.0
    assert found[("lmcache_tiers_failures_total", (("reason", "metrics_stat_not_a_number"),))] == 1.0
    assert f"{name}: stats() answered" in caplog.text


def test_the_stats_a_status_left_out_are_counted_per_adapter() -> None:
    """The status chooses the stats it carries (storage_status.py); the scrape exports them
    all and counts, per adapter, the values that status said it left out."""
    name = "0:per-object"
    registry = build_registry(lambda: [], lambda: {"adapters": [adapter], "failures": {}})
    adapter: dict[str, Any] = {"index": 0, "name": name, "type": "custom"}
    adapter["backend"] = {f"object_{n:05d}": n for n in range(MAX_EXPORTED_STATS)}
    adapter["backend"]["mode"] = "read-write"  # not a number: counted as before
    adapter["backend_stats_left_out"] = 10
    first = samples(render(registry).decode())
    second = samples(render(registry).decode())
    exported = {dict(labels)["stat"] for metric, labels in second if metric == "lmcache_tiers_adapter_stat"}
    assert exported == {f"object_{n:05d}" for n in range(MAX_EXPORTED_STATS)}
    left_out = ("lmcache_tiers_adapter_stats_left_out_total", (("adapter", name),))
    assert first[left_out] == 10
    assert second[left_out] == 20
    assert second[("lmcache_tiers_failures_total", (("reason", "metrics_stat_not_a_number"),))] == 2.0


def test_label_values_from_configuration_are_escaped() -> None:
    name = 'odd "name"\\with\na newline'
    text = collector_text({"index": 0, "name": name, "backend": {"objects": 1}})
    found = samples(text)
    assert found[("lmcache_tiers_adapter_stat", (("adapter", name), ("stat", "objects")))] == 1.0


@pytest.fixture
def endpoint() -> Iterator[HttpEndpoint]:
    big = b"x" * (16 << 20)  # more than a socket buffer: the write meets a closed peer
    served = HttpEndpoint("127.0.0.1", 0, metrics=lambda: big, status=lambda: {}, health=lambda: (True, "ok"))
    served.start()
    yield served
    served.stop()


def request(endpoint: HttpEndpoint, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    port = int(endpoint.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_head_answers_like_get_without_a_body(endpoint: HttpEndpoint) -> None:
    code, headers, body = request(endpoint, "HEAD", "/healthz")
    assert (code, headers["Content-Length"], body) == (200, "3", b"")
    assert request(endpoint, "HEAD", "/nowhere")[0] == 404


def test_methods_that_would_change_something_are_not_allowed(endpoint: HttpEndpoint) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        code, headers, body = request(endpoint, method, "/metrics")
        assert (code, headers["Allow"]) == (405, "GET, HEAD"), method
        assert body == f"{method} not allowed: the routes answer GET, HEAD\n".encode()
    assert request(endpoint, "POST", "/nowhere")[0] == 404


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} is not JSON")


def test_status_is_json_even_when_a_backend_answers_nan() -> None:
    """JSON has no NaN or Infinity: a document carrying one is refused by strict readers
    (JavaScript, Go, jq), which would lose the whole /status for one backend's stat."""
    document = {"adapters": [{"backend": {"latency_ms": float("nan"), "peak": float("-inf"), "ok": 1.5}}]}
    served = HttpEndpoint("127.0.0.1", 0, metrics=bytes, status=lambda: document, health=lambda: (True, "ok"))
    served.start()
    try:
        code, _headers, body = request(served, "GET", "/status")
    finally:
        served.stop()
    assert code == 200
    backend = json.loads(body, parse_constant=_no_constant)["adapters"][0]["backend"]
    assert backend == {"latency_ms": None, "peak": None, "ok": 1.5}


def test_a_scraper_that_hangs_up_prints_no_traceback(
    endpoint: HttpEndpoint, capfd: pytest.CaptureFixture[str]
) -> None:
    port = int(endpoint.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: tiers\r\n\r\n")
        # a reset, as a scraper at its timeout does: the server's write then fails
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.5)
    assert request(endpoint, "GET", "/healthz")[0] == 200  # still serving
    assert "Traceback" not in capfd.readouterr().err


def test_a_connection_that_sends_nothing_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle connection would otherwise hold one of the endpoint's threads for good."""
    monkeypatch.setattr("lmcache_tiers.server.http.REQUEST_TIMEOUT_S", 0.2, raising=False)
    served = HttpEndpoint("127.0.0.1", 0, metrics=bytes, status=dict, health=lambda: (True, "ok"))
    served.start()
    try:
        port = int(served.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
            assert idle.recv(1) == b""  # closed by the server, long before our own timeout
    finally:
        served.stop()


def test_a_connection_that_trickles_its_request_is_cut_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte now and then, each within the idle timeout, would otherwise hold one of the
    endpoint's threads for as long as the client likes (headers may run to megabytes)."""
    monkeypatch.setattr("lmcache_tiers.server.http.REQUEST_TIMEOUT_S", 0.5, raising=False)
    with counting_endpoint() as (served, counted):
        port = port_of(served)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            started = time.monotonic()
            cut = False
            while time.monotonic() - started < 4.0:
                try:
                    slow.sendall(b"X")
                except OSError:
                    cut = True
                    break
                time.sleep(0.2)
                slow.setblocking(False)
                try:
                    cut = slow.recv(1 << 16) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    cut = True
                slow.setblocking(True)
                if cut:
                    break
        assert cut, "the trickling connection was still open after 4 s (deadline 0.5 s)"
        assert counted == ["http_connection_timed_out"]
        assert request(served, "GET", "/healthz")[0] == 200  # still serving


def test_connections_beyond_the_limit_are_closed_at_once_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each connection holds a thread (and a descriptor) until it is done or cut: a client
    opening them without end would otherwise take threads and descriptors from the whole
    server.  Those over the limit are closed at once, counted; a slot that frees up
    serves again."""
    monkeypatch.setattr("lmcache_tiers.server.http.MAX_CONNECTIONS", 2, raising=False)
    with counting_endpoint() as (served, counted):
        port = port_of(served)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.3)  # both accepted and holding their threads
            with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
                assert extra.recv(1) == b""  # closed by the server, not left waiting
            assert counted == ["http_connection_refused_busy"]
        finally:
            for connection in idle:
                connection.close()
        deadline = time.monotonic() + 5
        while True:
            with contextlib.suppress(http.client.HTTPException, OSError):
                if request(served, "GET", "/healthz")[0] == 200:
                    break
            assert time.monotonic() < deadline, "the slots of closed connections were not given back"
            time.sleep(0.05)


class _GrowingWhileIterated(Counter[str]):
    """Failure reasons that gain a new one while being iterated, as when a front end's loop
    meets a new reason in the middle of a scrape."""

    def items(self) -> Any:
        for reason, count in super().items():  # a live view, as the merge iterates
            yield reason, count
            self[f"{reason}_again"] += 1


def test_a_scrape_while_a_front_end_counts_a_new_reason() -> None:
    busy = FrontendStats(failures=_GrowingWhileIterated(timeout=1))
    fronts = [("0:native", FrontendStats(failures=Counter(timeout=1))), ("1:lmcache_mp", busy)]
    text = render(build_registry(lambda: fronts, lambda: {"failures": {}})).decode()
    assert samples(text)[("lmcache_tiers_failures_total", (("reason", "timeout"),))] == 2.0


def test_status_takes_a_token_beyond_ascii_as_clients_send_it() -> None:
    """A header is bytes on the wire: a client (curl, Prometheus) sends the token's UTF-8,
    which must match however the server's header parser decoded it."""
    token = "pässwörd-€"
    served = HttpEndpoint(
        "127.0.0.1", 0, metrics=bytes, status=dict, health=lambda: (True, "ok"), status_token=token
    )
    served.start()
    try:
        port = int(served.url.rsplit(":", 1)[1])
        codes = []
        for offered in (f"Bearer {token}".encode(), b"Bearer wrong", f"Bearer {token}x".encode()):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                connection.putrequest("GET", "/status")
                connection.putheader("Authorization", offered)
                connection.endheaders()
                codes.append(connection.getresponse().status)
            finally:
                connection.close()
        assert codes == [200, 401, 401]
    finally:
        served.stop()


def test_refused_and_failed_http_requests_are_counted(make_server: Factory) -> None:
    """A /status refused for want of the token is a refusal like any other: counted, not
    only logged; so is a route that failed."""
    server = make_server(
        metrics_port=free_port(), metrics_host="0.0.0.0", server_options={"auth_token": "t0k"}
    )
    assert server.http_url is not None
    port = int(server.http_url.rsplit(":", 1)[1])
    status_url = f"http://127.0.0.1:{port}/status"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(status_url, timeout=10)
    assert refused.value.code == 401
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    assert samples(text)[("lmcache_tiers_failures_total", (("reason", "http_status_refused"),))] == 1.0
    with_token = urllib.request.Request(status_url, headers={"Authorization": "Bearer t0k"})
    with urllib.request.urlopen(with_token, timeout=10) as response:
        assert json.loads(response.read())["failures"]["http_status_refused"] == 1

    counted: list[str] = []

    def broken_status() -> dict[str, Any]:
        raise RuntimeError("a bug")

    served = HttpEndpoint(
        "127.0.0.1",
        0,
        metrics=bytes,
        status=broken_status,
        health=lambda: (True, "ok"),
        failed=counted.append,
    )
    served.start()
    try:
        assert request(served, "GET", "/status")[0] == 500
    finally:
        served.stop()
    assert counted == ["http_route_failed"]


def test_the_stats_of_one_adapter_in_the_status_are_capped(
    with_adapter: TiersServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """/status (and the native STATUS reply, the same document) would grow without bound
    with a plugin whose stats() has a key per object: past the cap of /metrics its stats
    are left out, the number said in the entry, counted and logged."""
    adapter = with_adapter.storage._parts.slots[0].adapter
    per_object = {f"object_{n:05d}": n for n in range(MAX_EXPORTED_STATS + 10)}
    monkeypatch.setattr(adapter, "stats", lambda: per_object)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        entry = with_adapter.status()["adapters"][0]
        entry_again = with_adapter.status()["adapters"][0]
    assert len(entry["backend"]) == MAX_EXPORTED_STATS
    assert entry["backend"] == entry_again["backend"], "the same stats are kept every time"
    assert entry["backend_stats_left_out"] == 10
    assert with_adapter.status()["failures"]["l2_stats_left_out"] == 30
    assert sum("over the cap of" in r.getMessage() for r in caplog.records) == 1


def test_stats_per_object_that_are_not_numbers_log_one_line_per_adapter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a burst log keyed by stat name would keep a key per object for ever, and log a line each
    adapter = {"index": 0, "name": "0:per-object-text", "type": "custom"}
    adapter["backend"] = {f"object_{n}": "text" for n in range(50)}
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        found = samples(collector_text(adapter))
    assert found[("lmcache_tiers_failures_total", (("reason", "metrics_stat_not_a_number"),))] == 50.0
    assert sum("is not a number" in r.getMessage() for r in caplog.records) == 1


def test_a_plugin_with_many_stats_does_not_push_out_the_core_s_own(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cap keeps the adapter's own stats first (its counters, the circuit breaker's
    gauges): ``lmcache-tiers status`` and /metrics read ``circuit_open`` and
    ``backend_errors`` from the capped entry, and a drop counted by the core must stay in
    /metrics, whatever names a plugin's 300 stats sort before."""
    adapter_config = json.dumps({"type": "mock", "max_size_gb": 0.1, "circuit": {"enabled": True}})
    server = make_server(adapters=[adapter_config], metrics_port=free_port())
    adapter = server.storage._parts.slots[0].adapter
    guard = adapter.backend
    per_object = {f"a_object_{n:05d}": n for n in range(300)}
    monkeypatch.setattr(guard.inner, "stats", lambda: per_object, raising=False)
    entry = server.status()["adapters"][0]
    backend = entry["backend"]
    assert len(backend) == len(adapter.own_stat_names()) + MAX_EXPORTED_STATS
    for own in ("circuit_open", "circuit_consecutive_failures", "pending_tasks", "pinned_keys", "objects"):
        assert own in backend, f"{own} was left out for the plugin's stats"
    assert entry["backend_stats_left_out"] == len(per_object) - MAX_EXPORTED_STATS
    found = samples(scrape(server))
    assert ("lmcache_tiers_adapter_circuit_open", (("adapter", entry["name"]),)) in found


def test_a_core_stat_that_first_appears_past_the_cap_is_exported(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The /metrics cap keeps the stats it exported before (no flapping series), but that
    applies to the plugin's stats only: a drop the core first counts after a plugin's 300
    stats filled the cap must still become an ``adapter_stat`` series."""
    server = make_server(adapters=[MOCK_ADAPTER], metrics_port=free_port())
    adapter = server.storage._parts.slots[0].adapter
    per_object = {f"a_object_{n:05d}": n for n in range(300)}
    monkeypatch.setattr(adapter.backend, "stats", lambda: per_object, raising=False)
    name = server.status()["adapters"][0]["name"]
    first = samples(scrape(server))
    new_drop = ("lmcache_tiers_adapter_stat", (("adapter", name), ("stat", "zz_core_drop")))
    assert new_drop not in first
    adapter.state.count("zz_core_drop", 3)  # counted by the core: one of the adapter's own
    second = samples(scrape(server))
    assert second[new_drop] == 3.0
    plugin_exported = {
        dict(labels)["stat"]
        for metric, labels in second
        if metric == "lmcache_tiers_adapter_stat" and dict(labels)["stat"].startswith("a_object_")
    }
    assert len(plugin_exported) <= MAX_EXPORTED_STATS


def _plugin_stats_in(server: TiersServer) -> tuple[set[str], set[str]]:
    """The plugin's stats (named ``*_object_*`` here) one /status read and one scrape carry."""
    entry = server.status()["adapters"][0]
    in_status = {stat for stat in entry["backend"] if "_object_" in stat}
    in_metrics = {
        dict(labels)["stat"]
        for metric, labels in samples(scrape(server))
        if metric == "lmcache_tiers_adapter_stat" and "_object_" in dict(labels)["stat"]
    }
    return in_status, in_metrics


def test_a_plugin_s_stats_kept_under_the_cap_stay_while_they_exist(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/status and /metrics keep the same plugin stats from one read to the next (a series
    that comes and goes reads as a counter reset) while the plugin still reports them,
    whatever new names sort before them; a stat the plugin stopped reporting frees its
    place for a new one, so a plugin whose objects churn is not left with none exported."""
    server = make_server(adapters=[MOCK_ADAPTER], metrics_port=free_port())
    adapter = server.storage._parts.slots[0].adapter
    per_object = {f"b_object_{n:05d}": n for n in range(300)}
    monkeypatch.setattr(adapter.backend, "stats", lambda: per_object, raising=False)
    first_status, first_metrics = _plugin_stats_in(server)
    assert len(first_status) == MAX_EXPORTED_STATS
    assert first_metrics == first_status
    per_object.update({f"a_object_{n:05d}": n for n in range(100)})  # sort before the kept
    again_status, again_metrics = _plugin_stats_in(server)
    assert again_status == first_status, "a plugin stat still reported left /status"
    assert again_metrics == first_status, "a plugin stat still reported left /metrics"
    per_object.clear()
    per_object.update({f"c_object_{n:05d}": n for n in range(300)})  # the old objects are gone
    churned_status, churned_metrics = _plugin_stats_in(server)
    assert len(churned_status) == MAX_EXPORTED_STATS
    assert churned_metrics == churned_status
