"""A store that answers but refuses every connection of the config is refused at start-up
(one line, exit 2), not taken for a store that is down and started anyway: its L2 would
fail every call while the warning said the store "does not answer yet"."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cli_config import CLI
from lmcache_plugin_redis.testing import RedisClusterNodes, RedisServer, free_port

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

WRONG_PASSWORD = "the-wrong-pw"


def test_credentials_the_store_rejects_are_refused_at_start_up(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    with pytest.raises(ConfigError, match=r"refused the credentials .*check username and password"):
        open_adapter(url=redis_server.url, key_prefix=prefix, username="nobody-here", password=WRONG_PASSWORD)


def test_credentials_a_cluster_rejects_are_refused_at_start_up(
    redis_cluster: RedisClusterNodes, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # redis-py's cluster client wraps the seeds' refusal in a RedisClusterException
    with pytest.raises(ConfigError, match="refused the credentials"):
        open_adapter(
            startup_nodes=redis_cluster.startup_nodes,
            cluster_mode=True,
            key_prefix=prefix,
            username="nobody-here",
            password=WRONG_PASSWORD,
        )


def test_a_database_the_store_does_not_have_is_refused_at_start_up(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/99"  # redis-server has 16 databases by default
    with pytest.raises(ConfigError, match="has no database 99"):
        open_adapter(url=url, key_prefix=prefix)


def test_serve_with_rejected_credentials_exits_2_in_one_line_without_the_password(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    url = redis_server.url.replace("redis://", f"redis://nobody-here:{WRONG_PASSWORD}@")
    adapter = json.dumps({"type": "redis", "url": url})
    serve = ["serve", "--no-default-l2", "--no-shm", "--l1-size-gb", "0.01", "--port", "0"]
    done = subprocess.run(
        [str(CLI), *serve, "--metrics-port", "0", "--l2-adapter", adapter],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr
    assert len(errors) == 1 and "refused the credentials" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert WRONG_PASSWORD not in done.stderr + done.stdout


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/abc",
        "redis://127.0.0.1:6379/1O",
        "redis://127.0.0.1:6379/0/x",
        "redis://127.0.0.1:6379/?db=abc",
        "unix:///run/redis.sock?db=x",
    ],
)
def test_a_url_database_that_is_not_a_number_is_refused_with_the_config(url: str) -> None:
    # redis-py took "/abc" or "/1O" for database 0 without a word (another cache's, perhaps),
    # and "?db=abc" failed the start with a bare ValueError (exit 1)
    with pytest.raises(ConfigError, match=r"database .* is not a number .* - at `\$\.l2_adapters\[0\]\.url`"):
        decode_adapter(load_registry(), {"type": "redis", "url": url}, 0)


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/3"]
)
def test_a_url_with_no_database_or_a_number_is_taken(url: str) -> None:
    decode_adapter(load_registry(), {"type": "redis", "url": url}, 0)


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://127.0.0.1:6379/0?socket_timeout=abc", "socket_timeout"),  # was a bare ValueError
        # the next three read as a store that "does not answer yet", and every call failed
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "ssl_cert_reqs"),  # TLS option, plain url
        ("redis://127.0.0.1:6379/0?protocol=9", "protocol"),
        ("redis://127.0.0.1:6379/0?sokcet_timeout=3", "sokcet_timeout"),
    ],
)
def test_a_url_option_redis_py_refuses_is_refused_with_the_config(url: str, named: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"refuses an option of the url: .*{named}.* - at `\$\.l2_adapters\[0\]\.url`"
    ):
        decode_adapter(load_registry(), {"type": "redis", "url": url}, 0)


def test_url_options_redis_py_takes_are_taken() -> None:
    for url in ("redis://127.0.0.1:6379/0?socket_timeout=3", "rediss://127.0.0.1:6379/0?ssl_cert_reqs=none"):
        decode_adapter(load_registry(), {"type": "redis", "url": url}, 0)
    # tls_enable makes a redis:// url TLS, whose options it then takes
    decode_adapter(
        load_registry(),
        {"type": "redis", "url": "redis://h:6379/0?ssl_cert_reqs=none", "tls_enable": True},
        0,
    )


@pytest.mark.parametrize("tls", ["url", "tls_enable"])
def test_tls_to_a_store_that_speaks_none_is_refused_at_start_up(
    redis_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter], tls: str
) -> None:
    # The store takes the connection and waits for a command while the client waits for
    # its TLS handshake: taken for a store that does not answer, it started with a dead L2.
    fields = {"url": redis_server.url.replace("redis://", "rediss://")}
    if tls == "tls_enable":
        fields = {"url": redis_server.url, "tls_enable": True}
    with pytest.raises(ConfigError) as raised:
        open_adapter(key_prefix=prefix, connection_timeout=1.0, request_timeout=1.0, **fields)
    node = redis_server.url.split("//", 1)[1].rsplit("/", 1)[0]
    assert f"{node} speaks no TLS (it answered a plain-text PING)" in str(raised.value)
    assert "use redis://" in str(raised.value)


@contextmanager
def tls_only_store(directory: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server answering TLS alone on a port of its own, with a self-signed
    certificate for 127.0.0.1: (its TLS port, the certificate)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for a TLS redis-server")
    key, cert = directory / "key.pem", directory / "cert.pem"
    request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
    subject = ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(["openssl", *request, *subject], check=True, capture_output=True)
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    server = RedisServer(directory / "redis", extra=[*tls, "--tls-auth-clients", "no"]).start()
    try:
        yield tls_port, cert
    finally:
        server.stop()


def test_a_tls_certificate_not_trusted_here_is_refused_at_start_up(
    tmp_path: Path, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # Every connection would fail the same verification until the CA given changes:
    # taken for a store that does not answer, it started with a dead L2.
    with tls_only_store(tmp_path) as (tls_port, cert):
        url = f"rediss://127.0.0.1:{tls_port}/0"
        with pytest.raises(ConfigError) as raised:
            open_adapter(url=url, key_prefix=prefix, connection_timeout=2.0, request_timeout=2.0)
        assert str(raised.value).startswith(
            f"0:redis: rediss://127.0.0.1:{tls_port}: the store's TLS certificate is not trusted "
            "(self-signed certificate): give its CA"
        )
        trusted = open_adapter(url=f"{url}?ssl_ca_certs={cert}", key_prefix=prefix)
        keys = make_keys(2)
        client = BlockingAdapterClient(trusted, timeout=30.0)
        assert client.store(keys, [pattern(i, 4096) for i in range(2)]) == [True, True], (
            "the CA given is used"
        )


def test_no_tls_to_a_store_that_speaks_tls_only_is_refused_at_start_up(
    tmp_path: Path, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    # The store resets a plain-text connection: taken for a store that does not answer,
    # it started with a dead L2.
    with tls_only_store(tmp_path) as (tls_port, _cert):
        with pytest.raises(ConfigError) as raised:
            open_adapter(url=f"redis://127.0.0.1:{tls_port}/0", key_prefix=prefix, connection_timeout=2.0)
        assert str(raised.value).startswith(
            f"0:redis: redis://127.0.0.1:{tls_port}: 127.0.0.1:{tls_port} speaks TLS only (it completed "
            "a TLS handshake), and the adapter connects without: use rediss://"
        )
