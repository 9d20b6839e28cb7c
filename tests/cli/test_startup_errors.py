"""Start-up problems of where the server keeps data and listens (L2 adapter paths and
directories, the default L2 taken, ports, hosts, IPC sockets): one line naming the flag or
config path, exit 2, on a narrow terminal too, and found before the L1 segment exists.  The
room L1 needs and the process's limits are checked in ``test_startup_limits.py``, mistakes
in the configuration itself in ``test_startup_config_mistakes.py``."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from startup_refusals import NARROW
from thirdparty import free_port, serve_cli

from lmcache_tiers.config import build_config
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.server import preflight


def _adapter_cases(a_file: Path) -> list[tuple[dict[str, object], str, str]]:
    """(adapter spec, the field path named, words the message holds)."""
    nixl_params = {"use_direct_io": "false", "max_capacity_gb": "1"}
    return [
        ({"type": "fs", "path": "/proc/lmcache-tiers-l2"}, "$.l2_adapters[0].path", "under /proc"),
        ({"type": "fs", "path": str(a_file / "l2")}, "$.l2_adapters[0].path", "is a file, not a directory"),
        (
            {"type": "fs", "base_path": str(a_file)},
            "$.l2_adapters[0].base_path",
            "is a file, not a directory",
        ),
        (
            {
                "type": "nixl_store_dynamic",
                "backend": "POSIX",
                "backend_params": {"file_path": "/sys/x", **nixl_params},
            },
            "$.l2_adapters[0].backend_params.file_path",
            "under /sys",
        ),
        (
            {
                "type": "raw_block",
                "device_path": str(a_file / "dev"),
                "capacity_bytes": 1 << 26,
                "slot_bytes": 1 << 20,
            },
            "$.l2_adapters[0].device_path",
            "is a file, not a directory",
        ),
        (
            {
                "type": "dax",
                "device_path": str(a_file.parent),
                "max_dax_size_gb": 0.25,
                "slot_bytes": 1 << 20,
            },
            "$.l2_adapters[0].device_path",
            "is a directory",
        ),
    ]


@pytest.mark.parametrize("case", range(6))
def test_an_unusable_adapter_path_names_the_field(case: int, a_file: Path, forked_cli: ForkedCli) -> None:
    adapter, field, words = _adapter_cases(a_file)[case]
    if adapter["type"] not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip(f"the {adapter['type']} adapter plugin is not installed")
    line = forked_cli.serve_refused(["--l2-adapter", json.dumps(adapter)])
    assert f"`{field}`" in line and words in line, line
    assert "File exists" not in line, line


def test_the_adapter_a_wrapper_wraps_is_checked_too(a_file: Path, forked_cli: ForkedCli) -> None:
    wrapped = {"type": "fault_inject", "inner": {"type": "fs", "path": str(a_file)}}
    line = forked_cli.serve_refused(["--l2-adapter", json.dumps(wrapped)])
    assert "fs: " in line and "`$.l2_adapters[0].inner.path`" in line, line


def test_a_second_adapter_is_checked_too(a_file: Path, tmp_path: Path, forked_cli: ForkedCli) -> None:
    good = {"type": "fs", "path": str(tmp_path / "good")}
    bad = {"type": "fs", "path": str(a_file)}
    line = forked_cli.serve_refused(["--l2-adapter", json.dumps(good), "--l2-adapter", json.dumps(bad)])
    assert "`$.l2_adapters[1].path`" in line, line
    assert not (tmp_path / "good").exists()  # the pre-flight creates nothing


def test_a_second_server_on_a_directory_a_running_server_holds_is_refused_before_l1(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    if "fs" not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip("the fs adapter plugin is not installed")
    locks = {"LMCACHE_TIERS_LOCK_DIR": str(tmp_path / "locks")}
    root = tmp_path / "l2"
    adapter = json.dumps({"type": "fs", "path": str(root)})
    first = serve_cli(["--l2-adapter", adapter, "--l1-size-gb", "0.25"], None, tmp_path / "first", **locks)
    try:
        # L1 is pre-faulted only after the pre-flight: a larger one changes nothing here
        result = forked_cli.run(
            [
                "serve",
                "--l2-adapter",
                adapter,
                "--l1-size-gb",
                "2",
                "--shm-name",
                f"tiers_preflight_{uuid.uuid4().hex[:10]}",
                "--port",
                str(free_port()),
                "--metrics-port",
                "0",
            ],
            LMCACHE_LOG_LEVEL="DEBUG",
            **NARROW,
            **locks,
        )
        assert first.proc.poll() is None, first.output()
    finally:
        first.stop()
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"error: fs: the fs directory {root} is in use by another lmcache-tiers server "
        f"(pid {first.proc.pid}); give each server its own directory - at `$.l2_adapters[0].path`"
    ], result.stderr
    assert "L1 arena" not in result.stderr + result.stdout  # what building L1 logs


def test_two_adapters_of_one_config_on_one_directory_are_refused_before_l1(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    if "fs" not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip("the fs adapter plugin is not installed")
    one = {"type": "fs", "path": str(tmp_path / "l2")}
    two = {"type": "fs", "base_path": f"file://{tmp_path}/l2/../l2"}
    line = forked_cli.serve_refused(
        ["--l2-adapter", json.dumps(one), "--l2-adapter", json.dumps(two)],
        LMCACHE_TIERS_LOCK_DIR=str(tmp_path / "locks"),
    )
    assert line == (
        f"error: fs: the fs directory {tmp_path}/l2/../l2 is already used by another adapter of this "
        "server; give each adapter its own directory - at `$.l2_adapters[1].base_path`"
    )
    assert os.listdir(tmp_path) == []  # neither the directory nor a lock file


def test_the_rpc_port_in_use_names_port(taken_port: int, forked_cli: ForkedCli) -> None:
    line = forked_cli.serve_refused(["--no-default-l2", "--port", str(taken_port)])
    assert line == (
        f"error: --port {taken_port}: 127.0.0.1:{taken_port} is already in use (another server?); "
        "stop it or give another port"
    )


def test_the_metrics_port_in_use_names_metrics_port(taken_port: int, forked_cli: ForkedCli) -> None:
    line = forked_cli.serve_refused(
        ["--no-default-l2", "--port", str(free_port()), "--metrics-port", str(taken_port)]
    )
    assert line.startswith(f"error: --metrics-port {taken_port}: 127.0.0.1:{taken_port} is already in use"), (
        line
    )


def test_a_front_end_port_in_use_names_its_config_path(taken_port: int, forked_cli: ForkedCli) -> None:
    frontends = [{"type": "native", "port": free_port()}, {"type": "lmcache_mp", "port": taken_port}]
    args = [arg for spec in frontends for arg in ("--frontend", json.dumps(spec))]
    line = forked_cli.serve_refused(["--no-default-l2", *args])
    assert line.startswith(f"error: $.frontends[1].port {taken_port}: "), line


def test_a_host_that_is_not_ours_names_host(forked_cli: ForkedCli) -> None:
    line = forked_cli.serve_refused(
        ["--no-default-l2", "--host", "192.0.2.1", "--auth-token", "t", "--port", str(free_port())]
    )
    assert line == "error: --host 192.0.2.1: not an address of this machine; give one of its addresses"


def test_a_host_that_is_not_ours_names_host_with_port_0_too(forked_cli: ForkedCli) -> None:
    """Port 0 (any free port) binds only on an address of this machine as well: refused
    before L1 is built, naming --host, not --port after L1 was pre-faulted."""
    line = forked_cli.serve_refused(
        ["--no-default-l2", "--host", "192.0.2.1", "--auth-token", "t", "--port", "0"]
    )
    assert line == "error: --host 192.0.2.1: not an address of this machine; give one of its addresses", line


@pytest.mark.parametrize("token", [[], ["--auth-token", "t"]])
@pytest.mark.parametrize("flag", ["--host", "--metrics-host"])
def test_a_host_naming_no_address_is_refused_as_such(
    flag: str, token: list[str], forked_cli: ForkedCli
) -> None:
    """A mistyped name is said to be one, not taken for a remote address that needs an auth
    token (without one) or for an address of another machine (with one)."""
    ports = ["--port", "0", "--metrics-port", str(free_port()) if flag == "--metrics-host" else "0"]
    line = forked_cli.serve_refused(["--no-default-l2", flag, "nosuchhost.invalid", *ports, *token])
    assert line.startswith(f"error: {flag} nosuchhost.invalid: names no address ("), line
    assert "auth" not in line and "give an address or a name this machine resolves" in line, line


def test_a_second_default_server_gets_the_hint_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked_cli: ForkedCli
) -> None:
    from lmcache_tiers import defaults

    cache = tmp_path / "cache"
    monkeypatch.setenv(defaults.CACHE_DIR_ENV, str(cache))
    held = defaults.claim_default_l2()  # what the first default server holds while it runs
    try:
        line = forked_cli.serve_refused(["--port", str(free_port())], LMCACHE_TIERS_CACHE_DIR=str(cache))
    finally:
        held.release()  # type: ignore[attr-defined]
    assert "already uses the default L2 cache" in line, line
    assert f"{defaults.CACHE_DIR_ENV}=<dir>" in line and "--no-default-l2" in line, line
    assert ".lock" not in line, line


def test_an_unusable_default_l2_directory_points_at_the_cache_dir_variable(
    a_file: Path, forked_cli: ForkedCli
) -> None:
    line = forked_cli.serve_refused(["--port", str(free_port())], LMCACHE_TIERS_CACHE_DIR=str(a_file))
    assert line.startswith(f"error: the embedded default L2 in {a_file}/l2 cannot be used ("), line
    assert "is a file, not a directory" in line and "$.l2_adapters" not in line, line
    assert "LMCACHE_TIERS_CACHE_DIR" in line and "--no-default-l2" in line, line


def test_an_ipc_socket_in_a_missing_or_wrong_directory_names_host(
    a_file: Path, tmp_path: Path, forked_cli: ForkedCli
) -> None:
    missing = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{tmp_path}/nowhere/tiers.sock"])
    assert missing == (
        f"error: --host ipc://{tmp_path}/nowhere/tiers.sock: {tmp_path}/nowhere does not exist; "
        "give a socket path in an existing directory"
    )
    under_file = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{a_file}/tiers.sock"])
    assert f"{a_file} is a file, not a directory" in under_file, under_file
    a_directory = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{tmp_path}"])
    assert f"{tmp_path} is a directory; give the path of a socket file" in a_directory, a_directory


def test_an_ipc_path_longer_than_a_unix_socket_address_takes_is_refused(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    # sun_path holds 107 bytes and a NUL: the server could bind such a path (it binds in a
    # short private directory and renames), but no client could ever connect to it.
    too_long = f"{tmp_path}/" + "s" * (108 - len(f"{tmp_path}/"))
    line = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{too_long}"])
    assert line == (
        f"error: --host ipc://{too_long}: the socket path is 108 bytes, and a Unix socket "
        "address holds at most 107; give a shorter path"
    )
    assert not os.path.exists(too_long)


def test_an_ipc_path_whose_private_bind_directory_is_too_long_is_refused(
    tmp_path: Path, forked_cli: ForkedCli
) -> None:
    # The socket is bound as DIR/.tiers-XXXXXXXX/s first (18 bytes more than DIR), then linked.
    directory = tmp_path / ("d" * (90 - len(f"{tmp_path}/")))
    directory.mkdir()
    path = f"{directory}/s.sock"  # 97 bytes: a client could connect to it
    line = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{path}"])
    assert line == (
        f"error: --host ipc://{path}: the server binds it first as {directory}/.tiers-XXXXXXXX/s "
        "(108 bytes), and a Unix socket address holds at most 107; give a path in a shorter directory"
    )


def test_an_ipc_path_that_is_a_file_is_refused_and_left_alone(a_file: Path, forked_cli: ForkedCli) -> None:
    # ZeroMQ unlinks whatever is at an ipc:// path before binding.
    line = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{a_file}"])
    assert line == (
        f"error: --host ipc://{a_file}: {a_file} exists and is not a socket; give a path that does not exist"
    )
    assert a_file.read_bytes() == b"not a directory"


@pytest.fixture
def listening_socket(tmp_path: Path) -> Iterator[Path]:
    """A Unix socket another server listens on."""
    path = tmp_path / "tiers.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.bind(str(path))
        holder.listen()
        yield path


def test_an_ipc_socket_another_server_listens_on_is_refused(
    listening_socket: Path, forked_cli: ForkedCli
) -> None:
    line = forked_cli.serve_refused(["--no-default-l2", "--host", f"ipc://{listening_socket}"])
    assert line == (
        f"error: --host ipc://{listening_socket}: {listening_socket} is already in use (another server?); "
        "stop it or give another path"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(listening_socket))  # the first server's socket is still its own


def test_a_stale_ipc_socket_of_a_killed_server_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "tiers.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(path))  # closed without unlinking, as a killed server leaves it
    config = build_config(load_registry(), overrides={"host": f"ipc://{path}", "metrics_port": 0})
    preflight.check_listeners(config)
