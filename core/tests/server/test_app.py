"""Serving-process pieces: endpoints, HTTP routes, metrics, start-up refusals, CLI output."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import types
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from lmcache_tiers.cli.commands_server import bench, bench_table, status, status_tables
from lmcache_tiers.cli.output import fail
from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.config import L2AdapterConfig, ServerConfig, build_config
from lmcache_tiers.controllers.base import ControllerThread
from lmcache_tiers.endpoints import is_loopback, rpc_endpoint
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import KindRegistry
from lmcache_tiers.server.app import TiersServer, _print_error, run_server
from lmcache_tiers.server.benchmark import run_bench
from lmcache_tiers.server.logs import configure_logging
from lmcache_tiers.testing.ports import free_port, free_ports

Factory = Callable[..., TiersServer]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True), ("ipc:///tmp/x", True),
     ("0.0.0.0", False), ("10.1.2.3", False), ("::", False)],
)  # fmt: skip
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_endpoints() -> None:
    assert rpc_endpoint("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert rpc_endpoint("localhost", 0) == "tcp://127.0.0.1:*"
    assert rpc_endpoint("::1", 7) == "tcp://[::1]:7"
    assert rpc_endpoint("ipc:///run/tiers.sock", 5555) == "ipc:///run/tiers.sock"
    with pytest.raises(ConfigError):
        rpc_endpoint("tcp://127.0.0.1", 1)


def test_refuses_to_bind_off_loopback_without_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LMCACHE_TIERS_AUTH_TOKEN", raising=False)
    config = ServerConfig(host="0.0.0.0", port=free_port(), metrics_port=0, l1_size_gb=0.0625)
    assert run_server(config, banner=False) == 2
    assert "requires --auth-token" in capsys.readouterr().err


def test_a_busy_port_is_a_start_up_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig(port=port, metrics_port=0, l1_size_gb=0.0625, l1_shm_name="tiers_unit_busy")
        assert run_server(config, banner=False) == 2
    # A config built in code names the setting by its config key (serve names the flag).
    assert f"error: port {port}: 127.0.0.1:{port} is already in use" in capsys.readouterr().err
    assert not os.path.exists("/dev/shm/tiers_unit_busy")


class _BrokenAdapterConfig(L2AdapterConfig):
    """An adapter whose backend cannot be reached when it is built."""


def _unreachable_backend(config: _BrokenAdapterConfig, context: object) -> object:
    raise RuntimeError("backend unreachable: connection refused")


def test_a_plugin_that_fails_while_starting_is_one_line_and_exit_code_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin's own exception at start-up is not a configuration mistake: one line, exit
    code 1, the segment unlinked -- not a traceback out of ``serve``."""
    module = types.ModuleType("tiers_unit_broken_adapter")
    module._unreachable_backend = _unreachable_backend  # type: ignore[attr-defined]

    @hookimpl
    def tiers_register_l2_adapters(registry: KindRegistry) -> None:
        registry.add("broken", f"{module.__name__}:_unreachable_backend", _BrokenAdapterConfig)

    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    registry = discover({module.__name__: module}).registry
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = build_config(
        registry,
        {"port": free_port(), "metrics_port": 0, "l1_size_gb": 0.0625, "l1_shm_name": name},
        adapter_json=['{"type": "broken"}'],
    )
    try:
        assert run_server(config, registry=registry, banner=False) == 1
        err = capsys.readouterr().err
        assert (
            "error: cannot start the server: 0:broken: l2 adapter 'broken' "
            "from plugin 'tiers_unit_broken_adapter' "
            "failed to start: RuntimeError: backend unreachable: connection refused"
        ) in err
        assert "Traceback" not in err, err
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the failed start-up"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


class _NoDescribe:
    """A front end that binds its socket, then turns out not to be a Frontend (no
    ``describe``)."""

    built: list[Any] = []

    def __init__(self, config: Any, context: Any) -> None:
        from lmcache_plugin_frontend_native.frontend import NativeFrontend

        self.inner = NativeFrontend(config, context)
        self.name = context.name
        _NoDescribe.built.append(self.inner)

    def stop(self, *, force: bool = False) -> None:
        self.inner.stop(force=force)

    def join(self, timeout: float | None = None) -> bool:
        return bool(self.inner.join(timeout))


def test_a_front_end_that_is_not_a_frontend_leaves_no_socket_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused after it bound: its port is given back with everything else start-up built."""
    from lmcache_plugin_frontend_native import NativeConfig

    module = types.ModuleType("tiers_unit_no_describe_frontend")
    module._NoDescribe = _NoDescribe  # type: ignore[attr-defined]

    @hookimpl
    def tiers_register_frontends(registry: KindRegistry) -> None:
        registry.add("no_describe", f"{module.__name__}:_NoDescribe", NativeConfig)

    module.tiers_register_frontends = tiers_register_frontends  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(_NoDescribe, "built", [])
    registry = discover({module.__name__: module}).registry
    port = free_port()
    config = build_config(
        registry,
        {
            "port": port,
            "metrics_port": 0,
            "l1_size_gb": 0.0625,
            "l1_shm_name": f"tiers_unit_{uuid.uuid4().hex[:12]}",
        },
        frontend_json=['{"type": "no_describe"}'],
    )
    with pytest.raises(ConfigError, match="not a Frontend"):
        TiersServer(config, registry=registry)
    assert len(_NoDescribe.built) == 1
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))  # EADDRINUSE while the refused front end still listens


def test_a_signal_while_the_storage_starts_its_threads_unlinks_the_segment(
    monkeypatch: pytest.MonkeyPatch, new_threads: Callable[[str], list[threading.Thread]]
) -> None:
    """SIGTERM once L1 and the adapters exist but while the controllers' threads start:
    start-up stops, and neither the segment nor a running controller outlives it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    started = ControllerThread.start

    def start_then_signal(self: ControllerThread) -> None:
        started(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ControllerThread, "start", start_then_signal)
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name)
    try:
        assert run_server(config, banner=False) == 128 + signal.SIGTERM
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the interrupted start-up"
        controllers = ("l1-eviction", "l2-prefetch", "l2-store")
        assert not [thread for thread in new_threads("l") if thread.name in controllers and thread.is_alive()]
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_a_front_end_whose_banner_line_fails_still_serves_and_stops_cleanly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The banner is for people: a front end's ``describe`` that raises (a plugin's bug)
    costs its panel, not the server -- which serves, and on a stop closes everything."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    from lmcache_plugin_frontend_native.frontend import NativeFrontend

    def broken_describe(self: NativeFrontend) -> str:
        raise RuntimeError("describe is broken")

    monkeypatch.setattr(NativeFrontend, "describe", broken_describe)
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name)
    ready, returned = threading.Event(), threading.Event()

    def stop_once_ready() -> None:
        if ready.wait(30) and not returned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_once_ready, daemon=True)
    stopper.start()
    try:
        with caplog.at_level(logging.ERROR, logger="lmcache_tiers"):
            assert run_server(config, ready=ready, banner=True) == 0
        assert ready.is_set()
        assert "describe is broken" in caplog.text
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the stop"
    finally:
        returned.set()
        ready.set()
        stopper.join(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_a_front_end_whose_stop_raises_still_lets_the_server_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """A front end's ``stop`` that raises (a plugin's bug) must not cut the close short:
    the L2 flush, the storage's close and the segment's unlink still happen."""
    from lmcache_plugin_frontend_native.frontend import NativeFrontend

    stop = NativeFrontend.stop

    def stop_then_raise(self: NativeFrontend, *, force: bool = False) -> None:
        stop(self, force=force)
        raise RuntimeError("stop is broken")

    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    server = TiersServer(ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name))
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve()
        except BaseException as exc:  # the serving thread's own stop meets the bug first
            failed.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setattr(NativeFrontend, "stop", stop_then_raise)
    try:
        server.request_stop()
        thread.join(30)
        assert not thread.is_alive()
        server.close()
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the close"
    finally:
        monkeypatch.setattr(NativeFrontend, "stop", stop)
        server.storage.close(drain_timeout_s=0.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_log_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    package = logging.getLogger("lmcache_tiers")
    before = package.level
    try:
        monkeypatch.setenv("LMCACHE_LOG_LEVEL", "debug")
        configure_logging()
        assert package.level == logging.DEBUG
        monkeypatch.setenv("LMCACHE_LOG_LEVEL", "chatty")
        configure_logging()
        assert package.level == logging.INFO
    finally:
        package.setLevel(before)


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_http_routes_and_per_server_metrics(make_server: Factory) -> None:
    first_port, second_port = free_ports(2)
    first = make_server(metrics_port=first_port)
    second = make_server(metrics_port=second_port)  # a second registry in one process must not collide
    assert first.http_url and second.http_url
    key = ObjectKey("unit", 0, b"metrics")
    with Client(first.endpoint) as client:
        client.store([key], [b"x" * 5000])
        assert client.lookup([key]) == 1
        client.release([key])
    code, text = fetch(f"{first.http_url}/metrics")
    assert code == 200
    assert 'lmcache_tiers_lookup_hit_chunks_total{tier="l1"} 1.0' in text
    assert 'lmcache_tiers_bytes_total{direction="store"} 5000.0' in text
    assert "lmcache_tiers_store_chunks_total 0.0" in fetch(f"{second.http_url}/metrics")[1]
    code, body = fetch(f"{first.http_url}/status")
    assert code == 200 and json.loads(body)["l1"]["objects"] == 1
    assert fetch(f"{first.http_url}/healthz") == (200, "ok\n")
    assert fetch(f"{first.http_url}/metrics/../status")[0] == 404
    first.frontends[0].rpc.draining = True  # a front end draining: /healthz names it
    try:
        assert fetch(f"{first.http_url}/healthz") == (503, "0:native: shutting down\n")
    finally:
        first.frontends[0].rpc.draining = False


def test_status_command_and_tables(server: TiersServer) -> None:
    app = typer.Typer()
    app.command()(status)
    app.command("bench")(bench)
    result = CliRunner().invoke(app, ["status", "--url", server.endpoint])
    assert result.exit_code == 0, result.output
    assert server.endpoint in result.output and "objects" in result.output
    document = json.loads(CliRunner().invoke(app, ["status", "--url", server.endpoint, "--json"]).output)
    assert document["server"]["endpoint"] == server.endpoint
    document["adapters"] = [{"name": "0:mock", "usage": 0.5, "used_bytes": 1 << 30, "keys_stored": 3}]
    document["failures"] = {"l2_load_failed": 2}
    titles = [table.title for table in status_tables(document)]
    assert titles == ["lmcache-tiers server", "L2 adapters", "failures"]
    unreachable = CliRunner().invoke(app, ["status", "--url", "tcp://127.0.0.1:9", "--timeout", "0.2"])
    assert unreachable.exit_code == 1


def test_status_adds_a_reason_counted_by_the_storage_and_a_front_end() -> None:
    """The storage and a front end may count the same reason (prefetch results expire in
    both): the table shows their sum, as /metrics does, not one of them."""
    document = {
        "failures": {"prefetch_result_expired": 2, "l2_load_failed": 1},
        "server": {"failures": {"prefetch_result_expired": 3, "reply_dropped": 4}},
    }
    failed = status_tables(document)[-1]
    assert failed.title == "failures"
    reasons, counts = (list(column.cells) for column in failed.columns)
    assert dict(zip(reasons, counts, strict=True)) == {
        "l2_load_failed": "1",
        "prefetch_result_expired": "5",
        "reply_dropped": "4",
    }


def scraped_failures_and_summary(
    server: TiersServer, before_scrape: Callable[[str], None]
) -> tuple[float, Any]:
    """Serve, call ``before_scrape`` with the HTTP endpoint's URL, sum the failures one
    /metrics scrape shows, stop: that sum and the stop summary."""
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        assert server.http_url is not None
        url = f"http://127.0.0.1:{int(server.http_url.rsplit(':', 1)[1])}"  # also when bound to all
        before_scrape(url)
        _, text = fetch(f"{url}/metrics")
        failures = [line for line in text.splitlines() if line.startswith("lmcache_tiers_failures_total")]
        scraped = sum(float(line.rsplit(" ", 1)[1]) for line in failures)
    finally:
        server.request_stop()
        thread.join(30)
        summary = server.close()
    return scraped, summary


def test_the_stop_summary_counts_the_failures_metrics_counted() -> None:
    """The summary's failures are those /metrics showed last: a refused /status and a
    controller step that raised are failures there, and at the stop too."""
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(
        port=0, metrics_port=free_port(), metrics_host="0.0.0.0", l1_size_gb=0.0625, l1_shm_name=name
    )
    server = TiersServer(config, auth_token="t0k")

    def refused_status_and_a_step_error(url: str) -> None:
        assert fetch(f"{url}/status")[0] == 401
        server.storage.l1_eviction.step_errors += 1  # as a step that raised counts itself

    scraped, summary = scraped_failures_and_summary(server, refused_status_and_a_step_error)
    assert scraped == 2
    assert summary["failures"] == scraped


def test_the_stop_summary_counts_a_stat_the_scrape_left_out() -> None:
    """A backend stat that is no finite number is a failure in /metrics (counted by the
    scrape itself, metrics_stat_not_a_number): the summary's failures are /metrics'."""
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=free_port(), l1_size_gb=0.0625, l1_shm_name=name)
    server = TiersServer(config)
    storage_status = server.storage.status

    def with_a_nan_stat() -> dict[str, Any]:
        document = storage_status()
        document["adapters"] = [{"index": 0, "name": "0:odd", "type": "odd", "backend": {"x": float("nan")}}]
        return document

    server.storage.status = with_a_nan_stat  # type: ignore[method-assign]
    scraped, summary = scraped_failures_and_summary(server, lambda url: None)
    assert scraped == 1
    assert summary["failures"] == scraped


def test_bench_runs_and_checks_its_bytes(server: TiersServer) -> None:
    steps: list[str] = []
    result = run_bench(
        server.endpoint, chunks=4, chunk_bytes=64 << 10, repeats=2, lookup_requests=64, step=steps.append
    )
    assert result.shm and result.memcpy_gbps > 0
    assert (
        result.store_gbps
        and result.retrieve_gbps
        and result.inline_store_gbps
        and result.inline_retrieve_gbps
    )
    assert result.lookup_p50_us <= result.lookup_p99_us
    assert result.lookup_per_s > 0 and result.lookup_pipelined_per_s > 0
    assert {"memcpy", "shm store", "inline retrieve", "lookup (pipelined)"} <= set(steps)
    assert bench_table(result).row_count == 11
    stats = server.storage.status()["l1"]
    assert (stats["objects"], stats["read_locks"]) == (0, 0), "the benchmark left data or locks behind"


def test_error_lines_leave_out_passwords_inside_urls(capsys: pytest.CaptureFixture[str]) -> None:
    """A component's refusal may quote the URL it refused, password and all."""
    refusal = "s3: endpoint_url must be an http:// or https:// URL, got 'ftp://u:pw1@h/?password=pw2'"
    with pytest.raises(SystemExit) as exited:
        fail(refusal)
    assert exited.value.code == 2
    _print_error(Console(stderr=True, highlight=False, soft_wrap=True), f"cannot start the server: {refusal}")
    printed = capsys.readouterr().err
    assert printed.count("ftp://u:***@h/?password=***") == 2, printed
    assert "pw1" not in printed and "pw2" not in printed


def test_a_client_with_a_timeout_too_long_for_one_poll_waits_for_its_server(make_server: Factory) -> None:
    """A timeout of days (or an infinite one) is a wait of that long for a server not up
    yet, not an overflow of the poll's milliseconds; NaN is no timeout at all."""
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        Client("tcp://127.0.0.1:9", timeout=float("nan"))
    port = free_port()
    outcome: dict[str, object] = {}

    def connect() -> None:
        try:
            with Client(f"tcp://127.0.0.1:{port}", timeout=float("inf"), shm=False) as client:
                outcome["ping"] = client.ping()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not outcome, outcome
    make_server(port=port)
    thread.join(30)
    assert "ping" in outcome, outcome


def test_lookups_sent_before_a_send_fails_give_their_locks_back(server: TiersServer) -> None:
    """A window of pipelined lookups whose third cannot be sent: the two sent before lock
    keys for this client, which it gives back when their replies land."""
    keys = [ObjectKey("unit", 0, f"pipelined-{index}".encode()) for index in range(3)]

    class ThirdSendFails(Client):
        sends = 0
        armed = False

        def _send(self, header: bytes, payloads: Any, deadline: float) -> int:
            if self.armed:
                self.sends += 1
                if self.sends == 3:
                    raise RequestTimeoutError("cannot reach the server")
            return super()._send(header, payloads, deadline)  # the connection it went over

    with ThirdSendFails(server.endpoint) as client:
        assert client.store(keys, [b"x" * 4096] * 3) == 3
        client.release(keys)
        client.armed = True
        with pytest.raises(RequestTimeoutError):
            client.lookup_many([[key] for key in keys])
        client.armed = False
        client.ping()  # the late replies land (their releases go out) before this one's
        client.ping()  # and those releases are handled before this one
        assert not client._outstanding
        assert server.storage.status()["l1"]["read_locks"] == 0


def _native_report_raises(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The native front end's ``method`` (stats, status or health) raises, as a front-end
    plugin's bug would."""
    from lmcache_plugin_frontend_native.frontend import NativeFrontend

    def broken(self: NativeFrontend) -> Any:
        raise RuntimeError(f"{method} is broken")

    monkeypatch.setattr(NativeFrontend, method, broken)


def test_a_front_end_whose_stats_raise_still_lets_the_server_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop summary reads every front end's counters: one ``stats()`` that raises must
    not cut the close short -- the L2 flush, the storage's close and the segment's unlink
    still happen, and the summary counts the failure."""
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    server = TiersServer(ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        server.request_stop()
        thread.join(30)
        assert not thread.is_alive()
        _native_report_raises(monkeypatch, "stats")
        summary = server.close()
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the close"
        assert summary["failures"] >= 1
    finally:
        server.storage.close(drain_timeout_s=0.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


def test_a_front_end_whose_reports_raise_costs_its_own_part_of_the_http_routes(
    make_server: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A front end's ``stats()``, ``status()`` or ``health()`` that raises leaves its own
    samples or entry out: /metrics and /status still answer with the storage's figures,
    /healthz says unhealthy (503, never a 500), and each failure is counted and logged."""
    server = make_server(metrics_port=free_port())
    assert server.http_url is not None
    for method in ("stats", "status", "health"):
        _native_report_raises(monkeypatch, method)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        code, text = fetch(f"{server.http_url}/metrics")
        assert code == 200
        assert "lmcache_tiers_l1_capacity_bytes" in text
        assert 'lmcache_tiers_failures_total{reason="frontend_report_error"}' in text
        code, body = fetch(f"{server.http_url}/status")
        assert code == 200
        document = json.loads(body)
        assert document["l1"]["objects"] == 0
        assert document["frontends"] == [{"name": "0:native", "error": "RuntimeError: status is broken"}]
        assert document["failures"]["frontend_report_error"] >= 2
        code, health = fetch(f"{server.http_url}/healthz")
        assert code == 503 and "health is broken" in health
    assert "stats is broken" in caplog.text and "status is broken" in caplog.text


def test_a_terminal_gone_during_the_flush_neither_stops_it_nor_leaves_the_segment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The flush's progress bar writes to the terminal: one that went away (a pty whose
    other end closed answers EIO) must not end the close before the storage's -- the
    flush goes on unseen, stores what was pending, and the segment is unlinked."""
    from lmcache_tiers.plugins import load_registry

    registry = load_registry()
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    slow = json.dumps({"type": "mock", "max_size_gb": 0.1, "latency_s": 1.0})
    config = build_config(
        registry,
        {"port": 0, "metrics_port": 0, "l1_size_gb": 0.0625, "l1_shm_name": name},
        adapter_json=[slow],
    )
    server = TiersServer(config, registry=registry)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    master, slave = os.openpty()
    terminal = os.fdopen(slave, "w")
    try:
        with Client(server.endpoint) as client:
            client.store([ObjectKey("unit", 0, b"flushed")], [b"x" * 5000])
        server.request_stop()
        thread.join(30)
        assert not thread.is_alive()
        os.close(master)  # the terminal is gone: every write to it fails with EIO
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
            summary = server.close(Console(file=terminal, force_terminal=True))
        assert not os.path.exists(f"/dev/shm/{name}"), "the L1 segment outlived the close"
        assert summary["l2_stores_pending"] == 1 and summary["l2_flushed"]
        assert server.storage.failures().get("l2_store_abandoned", 0) == 0
        assert "flush progress cannot be shown" in caplog.text
    finally:
        with contextlib.suppress(OSError):
            terminal.close()
        server.storage.close(drain_timeout_s=0.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
