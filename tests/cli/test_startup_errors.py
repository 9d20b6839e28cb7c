"""Start-up problems of the machine (paths, ports, L1 size, the default L2 taken): one
line naming the flag or config path, exit 2, on a narrow terminal too, and found before
the L1 segment exists."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from thirdparty import CLI, free_port, run_cli, run_cli_in_process, serve_cli

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.server import preflight
from lmcache_tiers.testing.mounts import tmpfs_at
from lmcache_tiers.tmpfs import is_tmpfs

#: a terminal narrower than every message: nothing may wrap
NARROW = {"COLUMNS": "40"}


def _serve_refused(args: list[str], **env: str) -> str:
    """Run ``serve ARGS`` with a segment name of its own; return its one error line,
    having checked the exit code and that no L1 segment was created."""
    shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
    result = run_cli(
        ["serve", "--l1-size-gb", "0.25", "--shm-name", shm, "--metrics-port", "0", *args], **NARROW, **env
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    assert "Errno" not in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert not os.path.exists(f"/dev/shm/{shm}")
    return lines[0]


def _print_config(args: list[str], monkeypatch: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    """``serve --print-config ARGS`` on a narrow terminal, run in this process
    (``run_cli_in_process``: the same output as the console script, without a Python start
    per case); ``serve`` itself stays a real process in ``_serve_refused``, which also
    checks that no L1 segment was made."""
    monkeypatch.setenv("COLUMNS", NARROW["COLUMNS"])
    return run_cli_in_process(["serve", "--print-config", *args])


def test_print_config_run_in_this_process_leaves_no_log_level_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # serve sets LMCACHE_LOG_LEVEL for its process; run in the test process it must not
    # reach the tests after this one (nor the servers they start).
    monkeypatch.delenv("LMCACHE_LOG_LEVEL", raising=False)  # the runner's own comes back after
    levels = _logger_levels()
    with pytest.MonkeyPatch.context() as case:
        printed = _print_config(["--no-default-l2"], case)
    assert printed.returncode == 0, printed.stderr
    assert "LMCACHE_LOG_LEVEL" not in os.environ, "print-config left the log level set"
    # nor the levels serve's logging set-up gives core's and the plugins' loggers
    assert _logger_levels() == levels


def _logger_levels() -> dict[str, int]:
    loggers = logging.root.manager.loggerDict.items()
    return {name: found.level for name, found in loggers if isinstance(found, logging.Logger) and found.level}


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "regular-file"
    path.write_bytes(b"not a directory")
    return path


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
def test_an_unusable_adapter_path_names_the_field(case: int, a_file: Path) -> None:
    adapter, field, words = _adapter_cases(a_file)[case]
    if adapter["type"] not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip(f"the {adapter['type']} adapter plugin is not installed")
    line = _serve_refused(["--l2-adapter", json.dumps(adapter)])
    assert f"`{field}`" in line and words in line, line
    assert "File exists" not in line, line


def test_the_adapter_a_wrapper_wraps_is_checked_too(a_file: Path) -> None:
    wrapped = {"type": "fault_inject", "inner": {"type": "fs", "path": str(a_file)}}
    line = _serve_refused(["--l2-adapter", json.dumps(wrapped)])
    assert "fs: " in line and "`$.l2_adapters[0].inner.path`" in line, line


def test_a_second_adapter_is_checked_too(a_file: Path, tmp_path: Path) -> None:
    good = {"type": "fs", "path": str(tmp_path / "good")}
    bad = {"type": "fs", "path": str(a_file)}
    line = _serve_refused(["--l2-adapter", json.dumps(good), "--l2-adapter", json.dumps(bad)])
    assert "`$.l2_adapters[1].path`" in line, line
    assert not (tmp_path / "good").exists()  # the pre-flight creates nothing


def test_a_second_server_on_a_directory_a_running_server_holds_is_refused_before_l1(tmp_path: Path) -> None:
    if "fs" not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip("the fs adapter plugin is not installed")
    locks = {"LMCACHE_TIERS_LOCK_DIR": str(tmp_path / "locks")}
    root = tmp_path / "l2"
    adapter = json.dumps({"type": "fs", "path": str(root)})
    first = serve_cli(["--l2-adapter", adapter, "--l1-size-gb", "0.25"], None, tmp_path / "first", **locks)
    try:
        # L1 is pre-faulted only after the pre-flight: a larger one changes nothing here
        result = run_cli(
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


def test_two_adapters_of_one_config_on_one_directory_are_refused_before_l1(tmp_path: Path) -> None:
    if "fs" not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip("the fs adapter plugin is not installed")
    one = {"type": "fs", "path": str(tmp_path / "l2")}
    two = {"type": "fs", "base_path": f"file://{tmp_path}/l2/../l2"}
    line = _serve_refused(
        ["--l2-adapter", json.dumps(one), "--l2-adapter", json.dumps(two)],
        LMCACHE_TIERS_LOCK_DIR=str(tmp_path / "locks"),
    )
    assert line == (
        f"error: fs: the fs directory {tmp_path}/l2/../l2 is already used by another adapter of this "
        "server; give each adapter its own directory - at `$.l2_adapters[1].base_path`"
    )
    assert os.listdir(tmp_path) == []  # neither the directory nor a lock file


def test_an_l1_larger_than_dev_shm_is_refused_before_mapping() -> None:
    line = _serve_refused(["--no-default-l2", "--l1-size-gb", "100000"])
    assert line.startswith("error: --l1-size-gb 100000: /dev/shm has"), line
    assert "GiB free" in line, line


def test_an_l1_larger_than_the_available_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # /dev/shm is often larger than the memory left: the second limit has its own line.
    monkeypatch.setattr(preflight, "_shm_free", lambda directory: 1 << 50)
    monkeypatch.setattr(preflight, "mem_available", lambda: 3 << 30)
    config = build_config(load_registry(), overrides={"l1_size_gb": 4.0})
    with pytest.raises(ConfigError, match=r"^l1_size_gb 4: this machine has 3.00 GiB of memory available"):
        preflight.check_l1_room(config)
    preflight.check_l1_room(build_config(load_registry(), overrides={"l1_size_gb": 2.0}))


def test_the_rpc_port_in_use_names_port(taken_port: int) -> None:
    line = _serve_refused(["--no-default-l2", "--port", str(taken_port)])
    assert line == (
        f"error: --port {taken_port}: 127.0.0.1:{taken_port} is already in use (another server?); "
        "stop it or give another port"
    )


def test_the_metrics_port_in_use_names_metrics_port(taken_port: int) -> None:
    line = _serve_refused(["--no-default-l2", "--port", str(free_port()), "--metrics-port", str(taken_port)])
    assert line.startswith(f"error: --metrics-port {taken_port}: 127.0.0.1:{taken_port} is already in use"), (
        line
    )


def test_a_front_end_port_in_use_names_its_config_path(taken_port: int) -> None:
    frontends = [{"type": "native", "port": free_port()}, {"type": "lmcache_mp", "port": taken_port}]
    args = [arg for spec in frontends for arg in ("--frontend", json.dumps(spec))]
    line = _serve_refused(["--no-default-l2", *args])
    assert line.startswith(f"error: $.frontends[1].port {taken_port}: "), line


def test_a_host_that_is_not_ours_names_host() -> None:
    line = _serve_refused(
        ["--no-default-l2", "--host", "192.0.2.1", "--auth-token", "t", "--port", str(free_port())]
    )
    assert line == "error: --host 192.0.2.1: not an address of this machine; give one of its addresses"


def test_a_second_default_server_gets_the_hint_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_tiers import defaults

    cache = tmp_path / "cache"
    monkeypatch.setenv(defaults.CACHE_DIR_ENV, str(cache))
    held = defaults.claim_default_l2()  # what the first default server holds while it runs
    try:
        line = _serve_refused(["--port", str(free_port())], LMCACHE_TIERS_CACHE_DIR=str(cache))
    finally:
        held.release()  # type: ignore[attr-defined]
    assert "already uses the default L2 cache" in line, line
    assert f"{defaults.CACHE_DIR_ENV}=<dir>" in line and "--no-default-l2" in line, line
    assert ".lock" not in line, line


def test_an_unusable_default_l2_directory_points_at_the_cache_dir_variable(a_file: Path) -> None:
    line = _serve_refused(["--port", str(free_port())], LMCACHE_TIERS_CACHE_DIR=str(a_file))
    assert line.startswith(f"error: the embedded default L2 in {a_file}/l2 cannot be used ("), line
    assert "is a file, not a directory" in line and "$.l2_adapters" not in line, line
    assert "LMCACHE_TIERS_CACHE_DIR" in line and "--no-default-l2" in line, line


def test_an_ipc_socket_in_a_missing_or_wrong_directory_names_host(a_file: Path, tmp_path: Path) -> None:
    missing = _serve_refused(["--no-default-l2", "--host", f"ipc://{tmp_path}/nowhere/tiers.sock"])
    assert missing == (
        f"error: --host ipc://{tmp_path}/nowhere/tiers.sock: {tmp_path}/nowhere does not exist; "
        "give a socket path in an existing directory"
    )
    under_file = _serve_refused(["--no-default-l2", "--host", f"ipc://{a_file}/tiers.sock"])
    assert f"{a_file} is a file, not a directory" in under_file, under_file
    a_directory = _serve_refused(["--no-default-l2", "--host", f"ipc://{tmp_path}"])
    assert f"{tmp_path} is a directory; give the path of a socket file" in a_directory, a_directory


def test_an_ipc_path_longer_than_a_unix_socket_address_takes_is_refused(tmp_path: Path) -> None:
    # sun_path holds 107 bytes and a NUL: the server could bind such a path (it binds in a
    # short private directory and renames), but no client could ever connect to it.
    too_long = f"{tmp_path}/" + "s" * (108 - len(f"{tmp_path}/"))
    line = _serve_refused(["--no-default-l2", "--host", f"ipc://{too_long}"])
    assert line == (
        f"error: --host ipc://{too_long}: the socket path is 108 bytes, and a Unix socket "
        "address holds at most 107; give a shorter path"
    )
    assert not os.path.exists(too_long)


def test_an_ipc_path_whose_private_bind_directory_is_too_long_is_refused(tmp_path: Path) -> None:
    # The socket is bound as DIR/.tiers-XXXXXXXX/s first (18 bytes more than DIR), then linked.
    directory = tmp_path / ("d" * (90 - len(f"{tmp_path}/")))
    directory.mkdir()
    path = f"{directory}/s.sock"  # 97 bytes: a client could connect to it
    line = _serve_refused(["--no-default-l2", "--host", f"ipc://{path}"])
    assert line == (
        f"error: --host ipc://{path}: the server binds it first as {directory}/.tiers-XXXXXXXX/s "
        "(108 bytes), and a Unix socket address holds at most 107; give a path in a shorter directory"
    )


def test_an_address_space_limit_below_l1_is_one_line_naming_ulimit() -> None:
    shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
    two_gib = 2 << 30
    result = subprocess.run(
        [*CLI, "serve", "--no-default-l2", "--l1-size-gb", "2.5", "--shm-name", shm, "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (two_gib, two_gib)),
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "error: cannot map a 2.50 GiB L1 segment: the process may not map that much (ulimit -v); "
        "lower --l1-size-gb or raise the limit"
    ), result.stderr
    assert not os.path.exists(f"/dev/shm/{shm}")


def _tmpfs_or_skip(directory: Path, options: str) -> Iterator[str]:
    with tmpfs_at(str(directory), options) as refused:
        if refused is not None:
            pytest.skip(refused)
        yield str(directory)


@pytest.fixture
def read_only_tmpfs(tmp_path: Path) -> Iterator[str]:
    yield from _tmpfs_or_skip(tmp_path / "ro", "size=4m,ro")


@pytest.fixture
def huge_tmpfs(tmp_path: Path) -> Iterator[str]:
    yield from _tmpfs_or_skip(tmp_path / "huge", "size=8m,huge=always")


def test_an_shm_dir_that_cannot_hold_the_arena_is_one_line(
    tmp_path: Path, a_file: Path, read_only_tmpfs: str
) -> None:
    on_disk = tmp_path / "on-disk"
    on_disk.mkdir()
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(a_file), "is a file, not a directory"),
        (read_only_tmpfs, "not writable"),
        ("relative", "give an absolute path"),
    ]
    if not is_tmpfs(str(on_disk)):
        cases.append((str(on_disk), "not on a tmpfs"))
    for directory, words in cases:
        line = _serve_refused(["--no-default-l2", "--shm-dir", directory])
        assert line.startswith(f"error: --shm-dir {directory}: "), line
        assert words in line, line


def test_a_huge_tmpfs_too_small_for_the_arena_is_refused_before_it_is_made(huge_tmpfs: str) -> None:
    line = _serve_refused(["--no-default-l2", "--shm-dir", huge_tmpfs])
    assert "lower it or enlarge" in line, line
    assert not os.listdir(huge_tmpfs)


def test_lmcache_mp_refuses_an_arena_outside_dev_shm(huge_tmpfs: str) -> None:
    spec = {"type": "lmcache_mp", "port": free_port()}
    line = _serve_refused(["--no-default-l2", "--shm-dir", huge_tmpfs, "--frontend", json.dumps(spec)])
    assert "LMCache clients open in /dev/shm" in line and f"--shm-dir {huge_tmpfs}" in line, line


def _config_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(serve arguments, the start of its one error line): mistakes in the configuration
    itself, which ``--print-config`` finds as ``serve`` does."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('host = "caf\u00e9"\n'.encode("latin-1"))
    inner_typo = {"type": "fault_inject", "inner": {"type": "nosuch"}}
    deep: list[object] = []
    for _ in range(600):
        deep = [deep]
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("host = " + "[" * 20_000 + "]" * 20_000 + "\n")
    return [
        (
            ["--l1-size-gb", "inf"],
            "error: --l1-size-gb: Expected a finite number, got inf - at `$.l1_size_gb`",
        ),
        (["--l1-size-gb", "1e308"], "error: --l1-size-gb: Expected `float` <= 1073741824.0"),
        (
            ["--l2-adapter", '{"type": "fs", "path": "/tmp/x", "max_capacity_gb": 1e400}'],
            "error: fs: Expected a finite number, got inf - at `$.l2_adapters[0].max_capacity_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "mock", "max_size_gb": 1e400}'],
            "error: mock: Expected a finite number, got inf - at `$.l2_adapters[0].max_size_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "mock", "max_size_gb": 1e300}'],
            "error: mock: Expected `float` <= 1073741824.0 - at `$.l2_adapters[0].max_size_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "redis", "url": "redis://:secret@h:99999/0"}'],
            "error: redis: the url's port must be a number from 1 to 65535 - at `$.l2_adapters[0].url`",
        ),
        (["--l2-adapter", json.dumps(inner_typo)], "error: unknown l2 adapter 'nosuch'"),
        (
            [
                "--l2-adapter",
                json.dumps({"type": "fault_inject", "inner": {"type": "mock", "max_size_gb": -1}}),
            ],
            "error: mock: Expected `float` > 0.0 - at `$.l2_adapters[0].inner.max_size_gb`",
        ),
        (["--shm-name", "a/b"], "error: --shm-name: shared-memory name 'a/b' is not allowed"),
        (["--l1-size-gb", "1e-9"], "error: --l1-size-gb 1e-09: smaller than one L1 extent of 4096 bytes"),
        (["--shm-dir", "relative"], "error: --shm-dir relative: give an absolute path"),
        (["--config", str(tmp_path)], f"error: config file '{tmp_path}' is a directory"),
        (["--config", str(latin1)], f"error: config file '{latin1}' is not valid TOML: it is not UTF-8 text"),
        # read up to a cap, not for ever
        (
            ["--config", "/dev/zero"],
            "error: config file '/dev/zero' is larger than 1 MiB; it is not a config file",
        ),
        (
            ["--shutdown-timeout", "-1"],
            "error: --shutdown-timeout: Expected `float` >= 0.0 - at `$.shutdown_timeout_s`",
        ),
        # a field taking any data, nested deep enough to exhaust the stack of what walks it
        (
            [
                "--l2-adapter",
                json.dumps({"type": "fs", "path": "memory://x", "storage_options": {"a": deep}}),
            ],
            "error: fs: Expected lists and tables nested at most 32 levels deep - at "
            "`$.l2_adapters[0].storage_options.a[0]",
        ),
        # nested past the parsers' own recursion limits
        (["--config", str(deep_toml)], f"error: config file '{deep_toml}' is not valid TOML: its values are"),
        (
            ["--l2-adapter", '{"type": "mock", "x": ' + "[" * 20_000 + "]" * 20_000 + "}"],
            "error: --l2-adapter #1 is not valid config JSON: it is nested too deeply",
        ),
    ]


@pytest.mark.parametrize("case", range(18))
def test_configuration_mistakes_are_found_by_print_config_as_by_serve(
    case: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, start = _config_cases(tmp_path)[case]
    line = _serve_refused(["--no-default-l2", "--port", str(free_port()), *args])
    assert line.startswith(start), line
    assert "secret" not in line
    printed = _print_config(["--no-default-l2", *args], monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == line


def test_the_inner_spec_of_a_wrapper_is_named_by_its_path() -> None:
    wrapped = {"type": "fault_inject", "inner": {"type": "nosuch"}}
    line = _serve_refused(["--no-default-l2", "--l2-adapter", json.dumps(wrapped)])
    assert line.endswith("- at `$.l2_adapters[0].inner.type`"), line
    assert "installed: " in line and "fault_inject `inner`" not in line, line


def test_dashed_l2_adapters_in_a_config_file_are_not_replaced_by_the_default_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "tiers.toml"
    config.write_text('[[l2-adapters]]\ntype = "mock"\nmax_size_gb = 0.5\n\n[[frontends]]\ntype = "native"\n')
    printed = _print_config(["--config", str(config)], monkeypatch)
    assert printed.returncode == 0, printed.stderr
    resolved = json.loads(printed.stdout)
    assert [(a["type"], a["max_size_gb"]) for a in resolved["l2_adapters"]] == [("mock", 0.5)]
    assert [f["type"] for f in resolved["frontends"]] == ["native"]
    config.write_text('[[l2-adapters]]\ntype = "mock"\n\n[[l2_adapters]]\ntype = "mock"\n')
    line = _serve_refused(["--config", str(config)])
    assert line == "error: config field `$.l2_adapters` is given twice (as `l2-adapters` and `l2_adapters`)"


def test_an_ipc_path_that_is_a_file_is_refused_and_left_alone(a_file: Path) -> None:
    # ZeroMQ unlinks whatever is at an ipc:// path before binding.
    line = _serve_refused(["--no-default-l2", "--host", f"ipc://{a_file}"])
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


def test_an_ipc_socket_another_server_listens_on_is_refused(listening_socket: Path) -> None:
    line = _serve_refused(["--no-default-l2", "--host", f"ipc://{listening_socket}"])
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


def test_a_shutdown_timeout_no_stop_can_wait_is_refused_before_start() -> None:
    # A deadline beyond what a thread join takes made the stop itself fail (OverflowError
    # joining the front ends): a traceback and exit 1 on SIGTERM instead of a drain.
    line = _serve_refused(["--no-default-l2", "--port", str(free_port()), "--shutdown-timeout", "1e300"])
    assert line == "error: --shutdown-timeout: Expected `float` <= 86400.0 - at `$.shutdown_timeout_s`"


def test_an_empty_config_path_is_refused_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--config "$TIERS_CONFIG"` with the variable unset must not serve the defaults.
    printed = _print_config(["--no-default-l2", "--config", ""], monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == "error: config file '' does not exist"


def test_a_non_utf8_auth_token_is_refused_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # A byte that is not UTF-8 in a flag reaches Python as a lone surrogate: --print-config
    # showed it, and serve built L1 and the front ends before encoding the token failed
    # ("cannot start the server: UnicodeEncodeError ...", exit 1).
    args = ["--no-default-l2", "--port", str(free_port()), "--auth-token", "\udcff"]
    line = _serve_refused(args)
    refusal = "Expected UTF-8 text, got a lone surrogate \\udcff - at `$.auth_token`"
    assert line == f"error: --auth-token: {refusal}"
    # in this process the flag is the str Python decodes the byte to, as in the console script
    printed = _print_config(args, monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == line


def _serve_with_open_files(limit: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``serve`` under ``ulimit -n LIMIT`` (soft and hard), stopped by its own refusal."""
    shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard limit of open files here is {hard}, below {limit}")
    result = subprocess.run(
        [*CLI, "serve", "--l1-size-gb", "0.25", "--shm-name", shm, "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **NARROW},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )
    assert not os.path.exists(f"/dev/shm/{shm}")
    return result


def test_an_open_files_limit_too_low_to_start_is_one_line_naming_ulimit_n() -> None:
    # Under `ulimit -n 16` the native front end's socket failed with a bare
    # "cannot start the server: ZMQError: Too many open files" (exit 1).
    result = _serve_with_open_files(16, "--no-default-l2", "--metrics-port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: ulimit -n 16: serve needs at least {preflight.SERVE_OPEN_FILES} open files to start "
        f"and about {preflight.RECOMMENDED_OPEN_FILES} to serve many clients; raise the hard limit "
        f"(ulimit -Hn {preflight.RECOMMENDED_OPEN_FILES}, or LimitNOFILE= in a systemd unit)"
    ], result.stderr


def test_a_start_that_runs_out_of_open_files_anyway_is_one_line_naming_ulimit_n(tmp_path: Path) -> None:
    # Above the pre-flight's floor, eight fs adapters still ran out: a bare ZMQError line.
    adapters = [
        arg
        for index in range(8)
        for arg in ("--l2-adapter", json.dumps({"type": "fs", "path": str(tmp_path / f"l2-{index}")}))
    ]
    if "fs" not in load_registry().names(Kind.L2_ADAPTER):
        pytest.skip("the fs adapter plugin is not installed")
    result = _serve_with_open_files(48, "--metrics-port", "0", *adapters)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: ulimit -n 48: serve ran out of open files while starting "
        f"(each L2 adapter and front end takes some); raise the hard limit "
        f"(ulimit -Hn {preflight.RECOMMENDED_OPEN_FILES}, or LimitNOFILE= in a systemd unit)"
    ), result.stderr


def test_a_low_open_files_limit_is_warned_about_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Enough to start, not for many clients: at the limit libzmq's accept fails with EMFILE
    # and retries, so the start says so once, naming the limit and what to raise it to.
    config = build_config(load_registry(), overrides={"l1_size_gb": 0.25})
    monkeypatch.setattr(preflight, "open_files_limit", lambda: 64)
    with caplog.at_level("WARNING", logger="lmcache_tiers.server.preflight"):
        preflight.check_open_files(config)
    assert [r.getMessage() for r in caplog.records] == [
        f"the open files limit (ulimit -n) is 64: a client connection, an L2 file or transfer each "
        f"take one, and at the limit new clients cannot connect; raise the hard limit "
        f"(ulimit -Hn, or LimitNOFILE= in a systemd unit) to {preflight.RECOMMENDED_OPEN_FILES} or more"
    ]
    caplog.clear()
    monkeypatch.setattr(preflight, "open_files_limit", lambda: preflight.RECOMMENDED_OPEN_FILES)
    preflight.check_open_files(config)
    assert caplog.records == []


def test_a_tmpfs_of_a_few_mib_says_how_many_mib_it_has_free(huge_tmpfs: str) -> None:
    # "0.01 GiB free" / "0.00 GiB free" said nothing about what was there.
    line = _serve_refused(["--no-default-l2", "--shm-dir", huge_tmpfs])
    assert f"{huge_tmpfs} has 8.0 MiB free" in line, line


def test_a_limit_that_serves_a_small_config_is_warned_about_not_refused(tmp_path: Path) -> None:
    # A fixed floor of 48 refused `serve --no-default-l2` under `ulimit -n 32`, a start
    # that holds about 20 descriptors and serves clients there: a refusal may only stop
    # what could not have worked; a limit that is merely low is the start's warning.
    limit = 32
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip(f"the hard limit of open files here is {hard}, below {limit}")
    shm = f"tiers_preflight_{uuid.uuid4().hex[:10]}"
    port = free_port()
    log = tmp_path / "serve.log"
    command = ["serve", "--no-default-l2", "--l1-size-gb", "0.25", "--shm-name", shm, "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, *command, "--metrics-port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **NARROW},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with Client(f"tcp://127.0.0.1:{port}", timeout=0.5, shm=False) as client:
                    assert client.ping() >= 0
                break
            except ClientError:
                assert time.monotonic() < deadline, log.read_text()
        assert f"the open files limit (ulimit -n) is {limit}" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(120)
    assert not os.path.exists(f"/dev/shm/{shm}")


def test_the_soft_open_files_limit_is_raised_to_the_hard_one_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A soft limit under a higher hard one (1024 under 524288 on most systems) was left as
    # it was: clients were refused at the soft limit the process could have raised itself.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit of open files here is {hard}, not above {low}")
    config = build_config(load_registry(), overrides={"l1_size_gb": 0.25})
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        with caplog.at_level("INFO", logger="lmcache_tiers.server.preflight"):
            preflight.check_open_files(config)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert [r.getMessage() for r in caplog.records] == [
        f"raised the open files limit (ulimit -n) from {low} to {shown}, the hard limit"
    ]


def test_a_server_whose_wake_pipe_is_above_fd_setsize_stops_cleanly() -> None:
    # With the soft limit raised to the hard one, a process holding over 1024 descriptors
    # gets its wake pipe above FD_SETSIZE: select() raised ValueError on it, and the serving
    # loop died instead of waiting for the stop.
    import threading

    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.server.app import TiersServer

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files here is {hard}, below 1200")
    preflight.raise_open_files_limit()
    filler: list[int] = []
    name = f"tiers_fdset_{uuid.uuid4().hex[:10]}"
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        server = TiersServer(ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name))
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                server.serve()
            except BaseException as exc:
                failed.append(exc)

        assert server._wake_read >= 1024
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(2.5)  # the loop wakes each second: a failing wait has ended it by now
        serving = thread.is_alive()
        server.request_stop()
        thread.join(30)
        server.close()
        assert failed == []
        assert serving and not thread.is_alive()
    finally:
        for fd in filler:
            os.close(fd)
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
