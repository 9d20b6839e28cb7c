"""The start-up probe of a remote NIXL backend's endpoint: bounded as a whole, its name
lookup included, and made the way the OBJ backend connects -- directly, whatever proxy
the environment names."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from lmcache_plugin_nixl.availability import check_remote_endpoint
from test_obj_backend import (
    ACCESS_KEY,
    BUCKET,
    HERE,
    SECRET_KEY,
    child_env,
    s3_endpoint,  # noqa: F401 - the S3 server fixture
)

from lmcache_tiers.config import FieldError
from lmcache_tiers.testing.ports import free_port


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield sock


def port_of(sock: socket.socket) -> int:
    port: int = sock.getsockname()[1]
    return port


def test_a_name_lookup_that_never_answers_is_given_up_at_the_probes_deadline() -> None:
    # getaddrinfo blocks for as long as the resolver does (a DNS server that does not
    # answer: its retries), and create_connection's timeout does not cover it.
    released = threading.Event()
    asked: list[str] = []

    def hanging(host: str, port: int) -> list[tuple[Any, ...]]:
        asked.append(host)
        released.wait()
        raise socket.gaierror(socket.EAI_AGAIN, "released by the test")

    params = {"bucket": "b", "endpoint_override": "http://s3.store.internal:9000"}
    try:
        with pytest.raises(
            FieldError,
            match=r"OBJ endpoint http://s3\.store\.internal:9000 \(s3\.store\.internal:9000\) cannot be "
            r"reached: the name s3\.store\.internal did not resolve within 0\.2 s",
        ):
            check_remote_endpoint("OBJ", params, timeout=0.2, environ={}, resolve=hanging)
    finally:
        released.set()
    assert asked == ["s3.store.internal"]


def test_a_resolver_error_is_the_reason_given(listening: socket.socket) -> None:
    def failing(host: str, port: int) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(FieldError, match=r"cannot be reached: .*Name or service not known"):
        check_remote_endpoint(
            "AZURE_BLOB", {"account_url": "http://acct.blob.internal"}, timeout=5, resolve=failing
        )


def test_the_obj_probe_connects_directly_and_names_a_proxy_it_does_not_use(
    listening: socket.socket,
) -> None:
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        proxy.setblocking(False)
        through_proxy = {
            "HTTP_PROXY": f"http://127.0.0.1:{port_of(proxy)}",
            "https_proxy": f"http://127.0.0.1:{port_of(proxy)}",
        }
        endpoint = f"http://127.0.0.1:{port_of(listening)}"
        check_remote_endpoint("OBJ", {"bucket": "b", "endpoint_override": endpoint}, environ=through_proxy)
        listening.accept()[0].close()  # the probe reached the endpoint itself
        with pytest.raises(BlockingIOError):
            proxy.accept()  # and nothing went to the proxy
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(FieldError, match=r"; HTTP_PROXY is set, but NIXL's OBJ backend does not use proxies"):
        check_remote_endpoint("OBJ", {"bucket": "b", "endpoint_override": closed}, environ=through_proxy)
    # NO_PROXY exempting the host, or no proxy variable at all: no word of proxies.
    for environ in ({**through_proxy, "NO_PROXY": "localhost,127.0.0.1"}, {}):
        with pytest.raises(FieldError) as refused:
            check_remote_endpoint("OBJ", {"bucket": "b", "endpoint_override": closed}, environ=environ)
        assert "proxy" not in str(refused.value).lower()


def test_nixl_obj_backend_itself_ignores_proxy_variables(s3_endpoint: str) -> None:  # noqa: F811
    # What the probe's direct connection rests on: NIXL's OBJ backend (the AWS SDK for C++,
    # allowSystemProxy off) reaches the endpoint directly with every proxy variable set.
    # Should a NIXL release start using them, this fails, and the probe must follow.
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        proxy.setblocking(False)
        address = f"http://127.0.0.1:{port_of(proxy)}"
        env = {key: value for key, value in child_env().items() if key.lower() != "no_proxy"}
        for name in ("http_proxy", "https_proxy", "all_proxy"):
            env[name] = env[name.upper()] = address
        done = subprocess.run(
            [sys.executable, str(HERE / "obj_roundtrip.py"), s3_endpoint, BUCKET, ACCESS_KEY, SECRET_KEY],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["stored"] == [True, True, True, False] and report["equal"] == [True] * 3
        with pytest.raises(BlockingIOError):
            proxy.accept()  # no request went to the proxy


@pytest.mark.parametrize(
    "account_url",
    ["http://acct..blob.internal:10000/dev", "http://" + "a" * 64 + ".blob.internal/dev"],
    ids=["empty label", "label over 63 characters"],
)
def test_a_host_name_that_cannot_be_encoded_is_refused_as_such(account_url: str) -> None:
    # The real resolver: getaddrinfo raises UnicodeError (not OSError) for a name IDNA cannot
    # encode, which the lookup thread must turn into the reason rather than let it escape
    # as a thread traceback and be told as a lookup that did not finish in time.
    escaped: list[BaseException | None] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        with pytest.raises(FieldError) as caught:
            check_remote_endpoint("AZURE_BLOB", {"account_url": account_url}, timeout=5)
    finally:
        threading.excepthook = previous
    message = str(caught.value)
    assert "is not a valid host name" in message
    assert "did not resolve" not in message
    assert escaped == []
