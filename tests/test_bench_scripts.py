"""The benchmark scripts' own checks: bad arguments refused in one line, a failed operation
never timed as a fast one, percentiles by rank, and nothing left behind by a benchmark
that run_all has to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from bench_modules import BENCH, load_bench


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
    )


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        (
            "bench_block.py",
            ["--adapters", "nvme", "--cases", "1x1", "--repeat", "1"],
            "unknown adapter 'nvme'",
        ),
        ("bench_block.py", ["--cases", "2y3"], "case '2y3' is not COUNTxMIB"),
        ("bench_block.py", ["--repeat", "0"], "0 is not >= 1"),
        ("bench_nixl.py", ["--cases", "0x1"], "count and MiB must both be >= 1"),
        ("bench_fs.py", ["--cases", "64"], "case '64' is not COUNTxMIB"),
        ("bench_engine.py", ["--prompts", "0"], "0 is not >= 1"),
        ("bench_serde.py", ["--shape", "2,0,4"], "shape '2,0,4': every dimension must be >= 1"),
        ("bench_serde.py", ["--shape", "2x8"], "shape '2x8' is not whole numbers separated by commas"),
        ("bench_serde.py", ["--count", "0"], "0 is not >= 1"),
        ("bench_serde.py", ["--repeat", "-1"], "-1 is not >= 1"),
        ("bench_leases.py", ["--shapes", "64"], "shape '64' is not COUNTxKIB"),
        ("bench_leases.py", ["--shapes", "0x4"], "count and KiB must both be >= 1"),
        ("bench_leases.py", ["--repeats", "0"], "0 is not >= 1"),
        ("bench_leases.py", ["--reap-locked", "1000,abc"], "'abc' is not a whole number"),
        ("bench_leases.py", ["--reap-locked", "0"], "0 is not >= 1"),
        ("bench_leases.py", ["--mass-expiry", "0"], "0 is not >= 1"),
        ("bench_record_decode.py", ["--count", "0"], "0 is not >= 1"),
    ],
)
def test_a_bad_argument_is_one_error_line_and_exit_2(
    script: str,
    args: list[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: ``--adapters nvme`` measured dax under the name nvme, a malformed case was a
    ValueError traceback, ``--repeat 0`` a StatisticsError after the whole run's set-up.

    The script's main() runs in this process, as ``python bench/SCRIPT ARGS`` would run it
    (its argv, bench/ first on the path, the repository as the working directory): a
    refusal is an exit with code 2, anything else (an exception, a run that starts)
    fails the test, without a Python start and the script's imports per case."""
    module = load_bench(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), *args])
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.chdir(BENCH.parent)
    with pytest.raises(SystemExit) as exited:
        module.main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2, out + err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and says in last


def test_an_engine_store_that_does_not_reach_l2_stops_the_run() -> None:
    """bench_engine: an L2 too small for the data fails most stores; the store figure
    (all bytes over the time of the failing stores) was printed as a fast one."""
    result = run_script(
        "bench_engine.py",
        *("--chunk-mb", "1", "--chunks", "4", "--prompts", "4", "--repeats", "1", "--l1-gb", "0.1"),
        *("--mock", '{"prefault": true, "max_size_gb": 0.004}', "--json"),
    )
    assert result.returncode != 0
    assert "store: the L2 adapters hold [4] of 16 objects" in result.stderr
    assert "store_gbps" not in result.stdout


def test_percentiles_are_by_nearest_rank() -> None:
    percentile = load_bench("bench_allocator").percentile
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    twenty = [float(value) for value in range(1, 21)]
    assert percentile(twenty, 0.05) == 1.0
    assert percentile(twenty, 0.95) == 19.0
    assert percentile(list(range(1, 101)), 0.07) == 7
    assert percentile([5.0], 0.95) == 5.0


def test_a_short_baseline_read_of_bench_fs_stops_the_run(tmp_path: Path) -> None:
    """bench_fs: a truncated baseline file was read short and timed as a fast preadv."""
    bench_fs = load_bench("bench_fs")
    (tmp_path / "raw-0.bin").write_bytes(b"x" * 100)
    target = memoryview(bytearray(4096))
    with pytest.raises(SystemExit, match="raw preadv of object 0 moved 100 of 4096 bytes"):
        bench_fs.raw_load(str(tmp_path), [target], direct=False)


def test_a_short_baseline_read_of_bench_block_stops_the_run(tmp_path: Path) -> None:
    """bench_block: the baselines' byte counts were checked by ``assert`` alone (gone
    under ``python -O``, and an AssertionError rather than a reason)."""
    bench_block = load_bench("bench_block")
    case = bench_block.Case(2, 4096)
    sources = [memoryview(bytearray(4096)) for _ in range(2)]
    targets = [memoryview(bytearray(4096)) for _ in range(2)]
    path = tmp_path / "baseline.img"
    fd, write, read = bench_block.file_baseline(str(path), case, sources, targets, False)
    try:
        write(1)
        os.truncate(path, 4096 + 10)
        with pytest.raises(SystemExit, match="preadv of object 1 moved 10 of 4096 bytes"):
            read(1)
    finally:
        os.close(fd)


FAKE_BENCH = """
import os, pathlib, subprocess, sys, time
here = pathlib.Path(sys.argv[0]).parent
(here / "bench.pid").write_text(str(os.getpid()))
marker = here / "segment"
marker.write_text("")
server = subprocess.Popen(["sleep", "600"])
try:
    # in the try: a stop sent once this file is there always runs the clean-up
    (here / "server.pid").write_text(str(server.pid))
    while True:
        time.sleep(0.05)  # short: a signal landing just before one starts waits for its end
finally:
    marker.unlink()
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("run_all_sigint", ["handled", "ignored"])
def test_a_benchmark_that_times_out_is_stopped_with_the_processes_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_all_sigint: str
) -> None:
    """run_all: a timed-out benchmark was killed alone (SIGKILL), so the server it had
    started kept running and its clean-up (a /dev/shm segment, here a marker file) never ran.
    Also when run_all runs with SIGINT ignored (a script's background job): the benchmark
    inherited that, and the SIGINT stopping it skipped its clean-up."""
    run_all = load_bench("run_all")
    (tmp_path / "bench_hangs.py").write_text(FAKE_BENCH)
    monkeypatch.setattr(run_all, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(run_all, "STOP_GRACE_S", 10.0, raising=False)
    server_pid = tmp_path / "server.pid"

    class TimesOutOnceStarted(subprocess.Popen):  # type: ignore[type-arg]
        """run_all's wait for the benchmark times out as soon as the benchmark has started
        its server, instead of after the whole timeout: the same timeout path, taken at
        the moment it exists for, without sitting the timeout out."""

        timed_out = False

        def communicate(self, input: Any = None, timeout: float | None = None) -> Any:
            if timeout is None or self.timed_out:
                return super().communicate(input, timeout)
            self.timed_out = True
            deadline = time.monotonic() + 60
            while not (server_pid.exists() and server_pid.read_text()):
                assert self.poll() is None and time.monotonic() < deadline, "the benchmark never started"
                time.sleep(0.02)
            raise subprocess.TimeoutExpired(self.args, timeout)

    shim = types.ModuleType("subprocess")
    shim.__dict__.update(vars(subprocess))
    shim.Popen = TimesOutOnceStarted  # type: ignore[attr-defined]
    monkeypatch.setattr(run_all, "subprocess", shim)
    previous = signal.signal(
        signal.SIGINT, signal.SIG_IGN if run_all_sigint == "ignored" else signal.default_int_handler
    )
    try:
        outcome = run_all.run_bench(run_all.Bench("hangs", "bench_hangs.py", timeout_s=3.0), False, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcome.error == "did not finish within 3 s"
    server = int(server_pid.read_text())
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(server), "the benchmark's server outlived it"
        assert not (tmp_path / "segment").exists(), "the benchmark's clean-up did not run"
    finally:
        if alive(server):
            os.kill(server, 9)


RUN_ALL_DRIVER = """
import pathlib, sys
sys.path.insert(0, sys.argv[1])
import run_all
run_all.BENCH_DIR = pathlib.Path(sys.argv[2])
run_all.run_bench(run_all.Bench("hangs", "bench_hangs.py", timeout_s=600.0), False, run_all.BENCH_DIR)
"""


def test_run_all_interrupted_stops_the_benchmark_it_runs(tmp_path: Path) -> None:
    """run_all: a benchmark runs in a session of its own, which a Ctrl-C at the terminal
    does not reach; interrupted, run_all left it running with the server it had started."""
    (tmp_path / "bench_hangs.py").write_text(FAKE_BENCH)
    (tmp_path / "driver.py").write_text(RUN_ALL_DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(BENCH), str(tmp_path)],
        # Ctrl-C at a terminal finds SIGINT at its default action, whatever this test run has
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    server_pid = tmp_path / "server.pid"
    try:
        deadline = time.monotonic() + 60
        while not server_pid.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server_pid.exists(), "the benchmark never started"
        driver.send_signal(signal.SIGINT)  # what Ctrl-C does to run_all
        driver.wait(timeout=60)
        server = int(server_pid.read_text())
        deadline = time.monotonic() + 10
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server), "the benchmark's server outlived run_all"
        assert not (tmp_path / "segment").exists(), "the benchmark's clean-up did not run"
    finally:
        driver.kill()
        driver.wait()
        kill_group_left_behind(tmp_path / "bench.pid")


def kill_group_left_behind(bench_pid: Path) -> None:
    """A failed test does not leave the benchmark's session running (it leads its group)."""
    if bench_pid.exists():
        try:
            os.killpg(int(bench_pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_allocator_pressure_phase_survives_an_emptied_arena() -> None:
    """bench_allocator: the pressure phase freed a random object half of the time even
    when none was left (a small ``--capacity-gb``), and crashed in ``randrange``."""
    import random

    bench_allocator = load_bench("bench_allocator")
    rng = random.Random(0)
    allocator = bench_allocator.ExtentAllocator(1 << 20, 4096)
    run = bench_allocator.Run(allocator, lambda: 4096, rng, 1)
    run.pressure(200)
    assert run.extent_ops > 0


def test_bench_fs_says_it_drops_the_machines_page_cache() -> None:
    """The reference part writes /proc/sys/vm/drop_caches (the whole machine's caches):
    its --help says so before anyone runs it."""
    result = run_script("bench_fs.py", "--help")
    assert result.returncode == 0
    assert "/proc/sys/vm/drop_caches" in result.stdout


def test_bench_fs_falls_back_to_fadvise_when_drop_caches_cannot_be_written(tmp_path: Path) -> None:
    """A drop_caches control that cannot be written (not root, a read-only /proc/sys) is
    no error: each file is evicted with posix_fadvise, and a file gone meanwhile is skipped."""
    from bench_modules import load_bench

    bench_fs = load_bench("bench_fs")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"x" * 8192)
    unwritable = tmp_path / "control-is-a-directory"
    unwritable.mkdir()
    method = bench_fs.drop_page_cache(
        [str(tmp_path / "data"), str(tmp_path / "gone")], control=str(unwritable)
    )
    assert method == "posix_fadvise DONTNEED"
