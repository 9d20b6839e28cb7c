"""A credential chain that never returns (a credential_process that hangs) stops start-up
after ``request_timeout_s`` with one line, instead of holding ``serve`` for good: the
bucket check waits on its probe with a bound."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from lmcache_plugin_s3 import S3Config
from s3_helpers import AWS_CREDENTIAL_VARIABLES, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.testing.seaweedfs import SeaweedS3
from lmcache_tiers.testing.threads import DEADLINE_S, joined, wait_until

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]
#: what the hanging credential_process sleeps: longer than any wait of these tests
HANG_S = 600


@contextlib.contextmanager
def hanging_credential_process(home: Path) -> Iterator[dict[str, str]]:
    """The environment of a user whose ~/.aws/config gets credentials from a process that
    never returns; the processes it started are killed (by their pid) afterwards."""
    pids = home / "credential-process.pids"
    script = home / "hang.sh"
    script.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep {HANG_S}\n")
    script.chmod(0o755)
    aws = home / ".aws"
    aws.mkdir()
    (aws / "config").write_text(f"[default]\ncredential_process = {script}\n")
    environ = {name: value for name, value in os.environ.items() if name not in AWS_CREDENTIAL_VARIABLES}
    environ.update(
        HOME=str(home),
        AWS_CONFIG_FILE=str(aws / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(aws / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        yield environ
    finally:
        for pid in pids.read_text().split() if pids.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def without_keys(seaweed: SeaweedS3, **fields: object) -> S3Config:
    """A config for ``seaweed`` that leaves the credentials to the AWS chain."""
    return s3_config(
        seaweed, fresh_prefix("hang"), aws_access_key_id=None, aws_secret_access_key=None, **fields
    )


def test_a_credential_process_that_never_returns_stops_start_up_with_one_line(
    seaweed: SeaweedS3, l1: memoryview, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with hanging_credential_process(tmp_path) as environ:
        for name in AWS_CREDENTIAL_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        config = without_keys(seaweed, request_timeout_s=3.0)
        refused: list[BaseException] = []

        def build() -> None:
            try:
                open_adapter(config, l1)
            except BaseException as exc:
                refused.append(exc)

        building = threading.Thread(target=build, name="test-build", daemon=True)
        building.start()
        joined(building, "building an s3 adapter whose credential_process never returns")
        started = (tmp_path / "credential-process.pids").read_text().split()
        assert started, "the credential_process never ran"
        for pid in started:  # the check gave up on it: it does not outlive the check
            wait_until(lambda pid=pid: not running(int(pid)), f"the killing of credential_process {pid}")
    assert len(refused) == 1 and isinstance(refused[0], ConfigError), refused
    assert str(refused[0]) == (
        "0:s3: no AWS credentials within request_timeout_s=3: the credential chain "
        "(a credential_process, SSO, an instance role) did not return"
    )


def test_serve_with_a_credential_process_that_never_returns_exits_2_in_one_line(
    seaweed: SeaweedS3, tmp_path: Path
) -> None:
    config = without_keys(seaweed, request_timeout_s=3.0)
    adapter = {
        "type": "s3",
        "bucket": config.bucket,
        "prefix": config.prefix,
        "endpoint_url": config.endpoint_url,
        "request_timeout_s": config.request_timeout_s,
    }
    with hanging_credential_process(tmp_path) as environ:
        done = subprocess.run(
            [
                *CLI,
                "serve",
                "--l1-size-gb",
                "0.0625",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--l2-adapter",
                json.dumps(adapter),
            ],
            env={**environ, "COLUMNS": "400"},
            capture_output=True,
            text=True,
            timeout=4 * DEADLINE_S,  # a bound on a hang, far above the refusal's 3 s
        )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert "no AWS credentials within request_timeout_s=3: " in errors[0]
