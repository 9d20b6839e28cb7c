"""The adapter against an S3 service that serves HTTPS only (SeaweedFS's gateway under a
certificate of a CA made for the test).  Its CA is trusted the way docs/adapters/s3.md
says, through ``AWS_CA_BUNDLE``; without it the certificate is refused, never accepted
silently.  A scheme that does not match the service -- ``http://`` to a TLS-only port,
``https://`` to a plain one -- stops start-up in one line naming the endpoint, where a
service that merely does not answer would not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from lmcache_plugin_s3 import S3Config
from s3_helpers import BUCKET, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]
SIZE = 256 << 10


@pytest.fixture(scope="module")
def seaweed_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with serving(tmp_path_factory.mktemp("seaweedfs-tls"), buckets=[BUCKET], tls=True) as server:
        yield server


@pytest.fixture
def no_ca(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)


def _open(config: S3Config, l1: memoryview, opened: list[L2Adapter]) -> L2Adapter:
    adapter = open_adapter(config, l1)
    opened.append(adapter)
    return adapter


def test_the_adapter_stores_and_loads_over_https_with_the_ca_in_aws_ca_bundle(
    seaweed_tls: SeaweedS3, l1: memoryview, opened: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert seaweed_tls.endpoint.startswith("https://")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(seaweed_tls.ca_path))
    adapter = _open(s3_config(seaweed_tls, fresh_prefix("tls")), l1, opened)
    keys = make_keys(2)
    payloads = [bytes([index + 1]) * SIZE for index in range(len(keys))]
    sources = [l1[index * SIZE : (index + 1) * SIZE] for index in range(len(keys))]
    for source, payload in zip(sources, payloads, strict=True):
        source[:] = payload
    assert blocking(adapter).store(keys, sources) == [True, True]
    found = blocking(adapter).lookup_and_lock(keys)
    assert found.found == [True, True]
    targets = [l1[(4 + index) * SIZE : (5 + index) * SIZE] for index in range(len(keys))]
    assert blocking(adapter).load(keys, targets) == [True, True]
    adapter.unlock(keys)
    assert [bytes(target) for target in targets] == payloads


def test_a_certificate_not_trusted_here_stops_start_up(
    seaweed_tls: SeaweedS3, l1: memoryview, opened: list[L2Adapter], no_ca: None
) -> None:
    with pytest.raises(ConfigError) as refused:
        _open(s3_config(seaweed_tls, fresh_prefix("tls")), l1, opened)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"0:s3: {seaweed_tls.endpoint} failed the TLS handshake"), line
    assert "CERTIFICATE_VERIFY_FAILED" in line, line


def test_http_to_a_tls_only_service_stops_start_up(
    seaweed_tls: SeaweedS3, l1: memoryview, opened: list[L2Adapter], no_ca: None
) -> None:
    plain = seaweed_tls.endpoint.replace("https://", "http://", 1)
    with pytest.raises(ConfigError) as refused:
        _open(s3_config(seaweed_tls, fresh_prefix("tls"), endpoint_url=plain), l1, opened)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"0:s3: {plain} speaks TLS, not plain HTTP ("), line
    assert line.endswith("use https:// in endpoint_url (with s3_endpoint, drop disable_tls)"), line


def test_https_to_a_plain_service_stops_start_up(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], no_ca: None
) -> None:
    secure = seaweed.endpoint.replace("http://", "https://", 1)
    with pytest.raises(ConfigError) as refused:
        _open(s3_config(seaweed, fresh_prefix("tls"), endpoint_url=secure), l1, opened)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"0:s3: {secure} failed the TLS handshake"), line


def test_serve_refuses_http_to_a_tls_only_service_in_one_line(seaweed_tls: SeaweedS3) -> None:
    plain = seaweed_tls.endpoint.replace("https://", "http://", 1)
    adapter = {"type": "s3", "bucket": BUCKET, "prefix": fresh_prefix("tls"), "endpoint_url": plain}
    flag = ["--l2-adapter", json.dumps(adapter)]
    without_ca = {name: value for name, value in os.environ.items() if name != "AWS_CA_BUNDLE"}
    done = subprocess.run(
        [*CLI, "serve", "--l1-size-gb", "0.0625", "--port", "0", "--metrics-port", "0", *flag],
        env={**without_ca, **seaweed_tls.env, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert f"{plain} speaks TLS, not plain HTTP" in errors[0], errors[0]
