"""``lmcache-tiers plugins new``: a package of each kind installs quietly, is listed, and
passes the suite it was generated with."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import zmq
from plugin_packages import environment, run_tests
from thirdparty import CLI, ServerProcess, free_port, run_cli, run_cli_in_process
from tiers_e2e import stop_signals_at_default

KINDS = {
    "l2": "l2_adapter",
    "store": "store_policy",
    "prefetch": "prefetch_policy",
    "eviction": "eviction_policy",
    "serde": "serde",
    "frontend": "frontend",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """One package of every kind, written by the CLI and installed into a site directory
    by one verbose pip run (like a user would: real metadata and entry points); that run's
    output, for the test that no package installs with warnings."""
    root = tmp_path_factory.mktemp("generated")
    site = root / "site"
    for kind in KINDS:
        # in this process: only the files written and the output matter here
        result = run_cli_in_process(["plugins", "new", f"gen-{kind}", "--kind", kind, "--dir", str(root)])
        assert result.returncode == 0, result.stderr
        assert f"wrote {root / f'gen-{kind}'}" in result.stdout
    pip = [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip, "--target", str(site), *(str(root / f"gen-{kind}") for kind in KINDS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    return root, site, build.stdout + build.stderr


@pytest.fixture(scope="module")
def generated(installed: tuple[Path, Path, str]) -> tuple[Path, Path]:
    root, site, _output = installed
    return root, site


def test_every_generated_package_is_listed_with_its_component(generated: tuple[Path, Path]) -> None:
    _root, site = generated
    listed = run_cli(["plugins", "list", "--json"], site)
    assert listed.returncode == 0, listed.stderr
    rows = {row["plugin"]: row for row in json.loads(listed.stdout)}
    for kind, label in KINDS.items():
        row = rows[f"gen-{kind}"]
        assert row["status"] == "ok", row
        assert row["components"] == [f"{label}:gen_{kind}"]
        assert row["distribution"] == f"lmcache-plugin-gen-{kind}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_generated_package_passes_its_own_tests(generated: tuple[Path, Path], kind: str) -> None:
    root, site = generated
    result = run_tests(root / f"gen-{kind}", site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


class ProtocolClient:
    """The generated front end's protocol: ``[op, JSON args, chunk...]`` on a DEALER."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.socket.connect(address)

    def call(self, op: str, args: dict[str, Any], chunks: tuple[bytes, ...] = ()) -> tuple[Any, list[bytes]]:
        """The reply's body and chunks; zmq.Again when no reply came in time."""
        self.socket.send_multipart([op.encode(), json.dumps(args).encode(), *chunks])
        status, body, *frames = self.socket.recv_multipart()
        assert status == b"ok", body
        return json.loads(body), frames

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def test_serve_runs_the_generated_front_end(generated: tuple[Path, Path], tmp_path: Path) -> None:
    """``serve`` accepts the generated front end as its only one, stores and reads back a
    chunk through it, and stops cleanly on SIGINT."""
    _root, site = generated
    port, shm_name = free_port(), f"tiers_gen_{uuid.uuid4().hex[:12]}"
    frontend = json.dumps({"type": "gen_frontend", "port": port})
    command = [*CLI, "serve", "--frontend", frontend, "--no-default-l2", "--l1-size-gb", "0.0625"]
    command += ["--metrics-port", "0", "--shm-name", shm_name]
    log_dir = tmp_path / "serve"
    log_dir.mkdir()
    with (log_dir / "stdout.txt").open("wb") as out, (log_dir / "stderr.txt").open("wb") as err:
        proc = subprocess.Popen(
            command, stdout=out, stderr=err, env=environment(site), preexec_fn=stop_signals_at_default()
        )
    server = ServerProcess(f"tcp://127.0.0.1:{port}", None, shm_name, proc, log_dir)
    try:
        deadline = time.monotonic() + 60
        while True:  # until it serves: a ping answered
            client = ProtocolClient(server.url, timeout_s=0.5)
            try:
                chunk_size = client.call("ping", {})[0]["chunk_size"]
                break
            except zmq.Again:
                client.close()
                assert proc.poll() is None, f"serve exited with {proc.returncode}\n{server.output()}"
                assert time.monotonic() < deadline, f"serve did not answer a ping\n{server.output()}"
        try:
            args = {"model": "m", "tokens": [7] * chunk_size}
            assert client.call("reserve", {**args, "size": 4096})[0] == {"missing": [0]}
            assert client.call("commit", args, (b"z" * 4096,))[0] == {"stored": 1}
            assert client.call("lookup", args)[0] == {"hits": 1}
            assert client.call("retrieve", args) == ({"hits": 1}, [b"z" * 4096])
        finally:
            client.close()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    assert server.stop(signal.SIGINT) == 0, server.output()
    assert "gen_frontend protocol" in server.output()  # its describe() in the banner


def test_generated_code_imports_only_the_public_plugin_api(generated: tuple[Path, Path]) -> None:
    root, _site = generated
    for source in root.glob("gen-*/src/**/*.py"):
        for line in source.read_text().splitlines():
            if line.startswith(("from lmcache_tiers", "import lmcache_tiers")):
                assert line.startswith("from lmcache_tiers.plugin import "), f"{source}: {line}"


def test_generated_code_passes_mypy_strict(generated: tuple[Path, Path]) -> None:
    """The packages ship py.typed, so their authors' type checks read them: the l2
    skeleton's get_many_into handed copy_into a ``bytes | None`` (a bool held in a variable
    narrowed nothing), and a freshly written plugin failed ``mypy --strict``."""
    root, _site = generated
    sources = [str(root / f"gen-{kind}" / "src") for kind in KINDS]
    # In the packages' directory: the repository's own mypy settings are not theirs.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *sources], cwd=root, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_generated_packages_install_without_warnings(installed: tuple[Path, Path, str]) -> None:
    _root, site, output = installed
    for kind in KINDS:  # each was built and installed by that run
        assert list(site.glob(f"lmcache_plugin_gen_{kind}-*.dist-info")), output[-3000:]
    assert "Warning" not in output and "deprecated" not in output.lower(), output[-3000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["Bad_Name", "--kind", "l2"], "lowercase letters and digits"),
        # `$` would match before the newline: the package would be written to "trailing\n"
        (["trailing\n", "--kind", "l2"], "lowercase letters and digits"),
        # installing either would disable (or replace) what is installed under that name
        (["fs", "--kind", "l2"], "lmcache-plugin-fs is installed"),
        (["default", "--kind", "store"], "store_policy:default is installed"),
        (["lru", "--kind", "eviction"], "eviction_policy:LRU is installed"),
        (["ok-name", "--kind", "cache"], "Invalid value for '--kind'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli_in_process(["plugins", "new", *args, "--dir", str(tmp_path)])
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    result = run_cli_in_process(["plugins", "new", "taken", "--kind", "store", "--dir", str(tmp_path)])
    assert result.returncode == 2
    assert "already exists" in result.stderr
    assert list((tmp_path / "taken").iterdir()) == []
