"""``--url`` of the commands that talk to a server: refused in one line when no client could
connect to it, and bracketed IPv6 addresses reach a server listening on one."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from thirdparty import run_cli, run_cli_in_process

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import ServerHarness


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("garbage", "'garbage' is not a server endpoint: give tcp://host:port or ipc://path"),
        ("tcp://127.0.0.1:99999", "the port must be a number from 1 to 65535, got '99999'"),
        ("tcp://127.0.0.1:0", "the port must be a number from 1 to 65535, got '0'"),
        ("tcp://127.0.0.1", "is not a server endpoint: give tcp://host:port"),
        ("tcp://::1:5555", "write an IPv6 address in brackets: tcp://[::1]:5555"),
        ("tcp://[nope]:5555", "[nope] is not an IPv6 address in brackets"),
        ("ipc://", "names no socket: give ipc://path"),
        ("http://127.0.0.1:5555", "is not a server endpoint"),
    ],
)
@pytest.mark.parametrize("command", ["status", "bench"])
def test_a_url_no_client_can_connect_to_is_a_usage_error(command: str, url: str, words: str) -> None:
    result = run_cli_in_process([command, "--url", url])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for '--url': "), lines
    assert words in lines[0], lines


def test_the_client_refuses_such_a_url_at_once() -> None:
    with pytest.raises(ClientError, match="the port must be a number from 1 to 65535"):
        Client("tcp://127.0.0.1:99999", timeout=30)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["status", "--timeout", "inf"], "Invalid value for '--timeout'"),
        (["status", "--timeout", "1e10"], "Invalid value for '--timeout'"),
        (["bench", "--chunk-mib", "inf"], "Invalid value for '--chunk-mib'"),
        (["bench", "--chunk-mib", "1e9"], "Invalid value for '--chunk-mib'"),
    ],
)
def test_waits_and_sizes_beyond_what_the_client_can_use_are_usage_errors(args: list[str], words: str) -> None:
    result = run_cli_in_process(args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.stderr, lines


def _no_ipv6_loopback() -> str | None:
    """Why this machine cannot listen on ::1, or None when it can."""
    if not socket.has_ipv6:
        return "Python here is built without IPv6"
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        return f"this machine has no IPv6 loopback address ::1 ({exc.strerror or exc})"
    return None


@pytest.fixture
def ipv6_server() -> Iterator[TiersServer]:
    reason = _no_ipv6_loopback()
    if reason is not None:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    harness = ServerHarness()
    try:
        yield harness.make(host="::1")
    finally:
        harness.close()


def test_status_reaches_a_server_on_ipv6_loopback(ipv6_server: TiersServer) -> None:
    url = ipv6_server.endpoint
    assert url.startswith("tcp://[::1]:"), url
    result = run_cli(["status", "--url", url, "--json", "--timeout", "30"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["server"]["endpoint"] == url
    with Client(url, timeout=30) as client:
        assert client.ping() > 0


def test_status_json_is_strict_json_when_a_stat_is_not_finite(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The native protocol carries a backend's NaN or infinite stat as it is; the printed
    # document must stay JSON (null), as HTTP /status writes it, not `NaN`.
    from lmcache_tiers.cli import connect
    from lmcache_tiers.cli.main import main

    class FakeClient:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> FakeClient:
            return self

        def __exit__(self, *args: object) -> None:
            pass

        def status(self) -> dict[str, object]:
            return {
                "adapters": [{"name": "0:x", "usage": float("nan"), "backend": {"lag": [float("inf"), 1.5]}}]
            }

    monkeypatch.setattr(connect, "wait_for_server", lambda *args, **kwargs: None)
    monkeypatch.setattr("lmcache_tiers.client.Client", FakeClient)
    main(["status", "--json"])
    printed = capsys.readouterr().out
    document = json.loads(printed, parse_constant=lambda name: pytest.fail(f"{name} in {printed}"))
    assert document["adapters"][0]["usage"] is None
    assert document["adapters"][0]["backend"]["lag"] == [None, 1.5]
