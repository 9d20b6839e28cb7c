"""Start-up problems of the room L1 needs (/dev/shm, memory, a tmpfs, ``ulimit -v``) and
of the process's open-files limit: one line naming the flag or the limit, exit 2, on a
narrow terminal too, and found before the L1 segment exists (or a warning where the limit
is merely low).  Where the server keeps data and listens is checked in
``test_startup_errors.py``, mistakes in the configuration itself in
``test_startup_config_mistakes.py``."""

from __future__ import annotations

import errno
import gc
import json
import os
import resource
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from startup_refusals import NARROW
from thirdparty import CLI, free_port

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.config import build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.server import preflight
from lmcache_tiers.testing.mounts import tmpfs_at
from lmcache_tiers.tmpfs import is_tmpfs


def test_an_l1_larger_than_dev_shm_is_refused_before_mapping(forked_cli: ForkedCli) -> None:
    line = forked_cli.serve_refused(["--no-default-l2", "--l1-size-gb", "100000"])
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
    tmp_path: Path, a_file: Path, read_only_tmpfs: str, forked_cli: ForkedCli
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
        line = forked_cli.serve_refused(["--no-default-l2", "--shm-dir", directory])
        assert line.startswith(f"error: --shm-dir {directory}: "), line
        assert words in line, line


def test_a_huge_tmpfs_too_small_for_the_arena_is_refused_before_it_is_made(
    huge_tmpfs: str, forked_cli: ForkedCli
) -> None:
    line = forked_cli.serve_refused(["--no-default-l2", "--shm-dir", huge_tmpfs])
    assert "lower it or enlarge" in line, line
    assert not os.listdir(huge_tmpfs)


def test_lmcache_mp_refuses_an_arena_outside_dev_shm(huge_tmpfs: str, forked_cli: ForkedCli) -> None:
    spec = {"type": "lmcache_mp", "port": free_port()}
    line = forked_cli.serve_refused(
        ["--no-default-l2", "--shm-dir", huge_tmpfs, "--frontend", json.dumps(spec)]
    )
    assert "LMCache clients open in /dev/shm" in line and f"--shm-dir {huge_tmpfs}" in line, line


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


@pytest.mark.parametrize(("limit", "advised"), [(48, 1024), (1024, 2048), (20000, 40000)])
def test_a_start_out_of_open_files_advises_a_hard_limit_above_the_one_it_ran_under(
    limit: int, advised: int
) -> None:
    line = str(preflight.open_files_refusal(limit, while_starting=True))
    assert line.endswith(f"raise the hard limit (ulimit -Hn {advised}, or LimitNOFILE= in a systemd unit)")


def test_a_listener_that_runs_out_of_open_files_names_ulimit_n_not_its_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Past the pre-flight, the HTTP endpoint's bind under `ulimit -n 30` (an fs and a redis
    # adapter open) read "--metrics-port 9090: cannot listen on ...: Too many open files",
    # sending the operator after the port.
    config = build_config(load_registry(), overrides={"l1_size_gb": 0.25})
    monkeypatch.setattr(preflight, "open_files_limit", lambda: 30)
    emfile = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    refused = preflight.listen_error(config, None, "127.0.0.1", 9090, emfile)
    assert str(refused).startswith("ulimit -n 30: serve ran out of open files while starting"), refused


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


def test_a_tmpfs_of_a_few_mib_says_how_many_mib_it_has_free(huge_tmpfs: str, forked_cli: ForkedCli) -> None:
    # "0.01 GiB free" / "0.00 GiB free" said nothing about what was there.
    line = forked_cli.serve_refused(["--no-default-l2", "--shm-dir", huge_tmpfs])
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


def test_a_server_whose_wake_pipe_is_above_fd_setsize_stops_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the soft limit raised to the hard one, a process holding over 1024 descriptors
    # gets its wake pipe above FD_SETSIZE: select() raised ValueError on it, and the serving
    # loop died instead of waiting for the stop.
    import threading

    from lmcache_tiers.config import ServerConfig
    from lmcache_tiers.server import app
    from lmcache_tiers.server.app import TiersServer

    # what the serving loop does each time its wait on the wake pipe returns
    woken = threading.Event()
    after_wait = app.report_held_back

    def noting_the_wake(*args: float) -> None:
        woken.set()
        after_wait(*args)

    monkeypatch.setattr(app, "report_held_back", noting_the_wake)

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files here is {hard}, below 1200")
    preflight.raise_open_files_limit()
    # Earlier tests' garbage closes its descriptors now: collected while the server is
    # built, it would free one under the filler for the wake pipe to take.
    gc.collect()
    filler: list[int] = []
    name = f"tiers_fdset_{uuid.uuid4().hex[:10]}"
    server: TiersServer | None = None
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
        os.write(server._wake_write, b"w")  # a wake that is no stop: the loop waits again
        deadline = time.monotonic() + 60
        while not woken.is_set() and thread.is_alive() and time.monotonic() < deadline:
            woken.wait(0.05)
        assert woken.is_set() or not thread.is_alive(), "the serving loop never returned from its wait"
        serving = thread.is_alive()  # a failing wait ends the loop as it starts
        server.request_stop()
        thread.join(30)
        closing, server = server, None
        closing.close()
        assert failed == []
        assert serving and not thread.is_alive()
    finally:
        if server is not None:  # a failed check must not leave its threads to the tests after
            server.close()
        for fd in filler:
            os.close(fd)
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
