"""``lmcache-tiers replay`` runs: simulations and plots, in-process and server replays,
and how a replay ends when its server dies or it is signalled.  What it refuses is in
test_replay_cli.py (a file of its own: each half is a test worker's share)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from replay_helpers import BLOCK_BYTES, output_of_killed, small_trace, start_block_server
from thirdparty import launch_cli, run_cli, run_cli_in_process
from tiers_e2e import ServerProcess

from lmcache_tiers.client import Client
from lmcache_tiers.client.connection import CLEANUP_TIMEOUT_S


def test_simulation_tables_name_every_policy_and_the_time(tmp_path: Path) -> None:
    result = run_cli_in_process(
        ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", "8,32"]
    )
    assert result.returncode == 0, result.stderr
    for text in ("exact LRU", "ARC", "S3FIFO", "PREFIX_LFU", "Belady", "infinite", "seconds per run"):
        assert text in result.stdout


def test_a_run_off_a_terminal_writes_nothing_on_stderr(tmp_path: Path) -> None:
    """Each progress bar, drawn nowhere off a terminal, still wrote an empty line to stderr:
    a log of runs gathered blank lines, and a script could not tell a clean run by it."""
    result = run_cli_in_process(
        ["replay", str(small_trace(tmp_path / "t.jsonl")), "--simulate", "--capacity", "8"]
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_tables_written_to_a_file_or_pipe_are_whole(tmp_path: Path) -> None:
    """Written to a pipe, the tables were cut to 80 columns: "0.97…" in place of a miss
    ratio, policy names cut short, in the very report saved for later."""
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--capacity", "8,16,32", "--foresight", "0,10,all"]
    result = run_cli(args, COLUMNS="80")
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout, result.stdout
    for name in ("PREFIX_LFU", "next use <= 10", "capacity (blocks)"):
        assert name in result.stdout, result.stdout


@pytest.mark.parametrize("word", ["reason", "x" * 300], ids=["words", "one-long-word"])
def test_a_report_off_a_terminal_is_at_most_200_columns_and_cuts_no_word(
    capsys: pytest.CaptureFixture[str], word: str
) -> None:
    """A long 'partial' reason made the whole table as wide as that one line; a word too
    long for 200 columns lost its end to an ellipsis."""
    from lmcache_tiers.cli.replay_cmd import _print_table
    from lmcache_tiers.replay.report import replay_table
    from lmcache_tiers.replay.run import ReplayOptions, ReplayReport, ReplayTotals

    stopped = " ".join([word] * 120)
    totals = ReplayTotals(requests=3, blocks=6, seconds=1.0)
    report = ReplayReport("server", "tcp://127.0.0.1:5555", ReplayOptions(), 1, totals, None, stopped)
    _print_table(replay_table(report.to_dict()))
    lines = capsys.readouterr().out.splitlines()
    # every character of the reason is there, none cut off for an ellipsis
    shown = "".join(line.replace("│", "").replace(" ", "") for line in lines)
    assert "…" not in shown and stopped.replace(" ", "") in shown, lines
    assert max(len(line) for line in lines) <= max(200, len(word) + 40), lines


def test_oracles_and_the_retimed_model_are_reported(tmp_path: Path) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--simulate", "--capacity", "8,16", "--foresight", "0,all", "--retime", "1"]
    result = run_cli_in_process([*args, "--json"])
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["analysis"]["retimed"]["seed"] == 1
    assert document["analysis"]["oracles"] == ["rate oracle", "next use <= 0", "next use"]
    for point in document["points"]:
        runs = {run["policy"]: run for run in point["runs"]}
        assert runs["next use <= 0"]["hit_blocks"] == runs["exact LRU"]["hit_blocks"]
        assert runs["next use"]["hit_blocks"] <= runs["Belady"]["hit_blocks"]
        assert 0.0 < point["online_bound_hit_rate"] < 1.0
    shown = run_cli_in_process(args)
    assert shown.returncode == 0, shown.stderr
    assert "re-timed" in shown.stdout and "bound on any online policy" in shown.stdout


def test_plot_writes_a_png(tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("SKIP: matplotlib is not installed (extra lmcache-tiers[plot])")
        pytest.skip("matplotlib is not installed (extra lmcache-tiers[plot])")
    png = tmp_path / "curve.png"
    trace = str(small_trace(tmp_path / "t.jsonl"))
    result = run_cli_in_process(
        ["replay", trace, "--simulate", "--capacity", "4,8,16", "--plot", str(png), "--json"]
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "curve.SVG"  # the format follows the extension, whatever its case
    result = run_cli_in_process(["replay", trace, "--simulate", "--capacity", "4,8", "--plot", str(svg)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith(f"plot written to {svg}")
    assert b"<svg" in svg.read_bytes()[:400]


def test_plot_under_the_longest_file_name_is_written(tmp_path: Path) -> None:
    """The image is drawn into a partial file beside it whose name held the whole --plot
    name: one near the file system's 255-byte limit was refused ('File name too long')."""
    pytest.importorskip("matplotlib")
    plot = tmp_path / ("c" * 251 + ".png")
    trace = str(small_trace(tmp_path / "t.jsonl"))
    result = run_cli_in_process(
        ["replay", trace, "--simulate", "--capacity", "8", "--plot", str(plot), "--json"]
    )
    assert result.returncode == 0, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(tmp_path.iterdir()) == sorted([plot, tmp_path / "t.jsonl"])


def test_plot_through_a_symbolic_link_writes_the_file_it_points_at(tmp_path: Path) -> None:
    """A --plot that was a symbolic link was replaced by the image (a rename over the link):
    the file it pointed at kept the old curve and the link was gone."""
    pytest.importorskip("matplotlib")
    shared = tmp_path / "shared"
    shared.mkdir()
    target = shared / "curve.png"
    target.write_bytes(b"the old curve")
    link = tmp_path / "latest.png"
    link.symlink_to(target)
    dangling = tmp_path / "next.png"
    dangling.symlink_to(shared / "next-curve.png")  # not there yet: created, as open would
    trace = str(small_trace(tmp_path / "t.jsonl"))
    for plot in (link, dangling):
        result = run_cli_in_process(
            ["replay", trace, "--simulate", "--capacity", "8", "--plot", str(plot), "--json"]
        )
        assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert dangling.is_symlink() and os.readlink(dangling) == str(shared / "next-curve.png")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (shared / "next-curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in shared.iterdir()) == ["curve.png", "next-curve.png"]  # no partial file


def test_in_process_replay_reports_json(tmp_path: Path) -> None:
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = ["replay", trace, "--in-process", "--l1-blocks", "20", "--block-bytes", str(BLOCK_BYTES), "--json"]
    result = run_cli_in_process(args)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["mode"] == "in-process" and document["requests"] == 60
    assert document["corrupt_blocks"] == 0 and document["failed_requests"] == 0
    assert document["hit_blocks"] == document["l1_hit_blocks"] > 0
    assert document["bytes"]["l1_retrieved"] == document["hit_blocks"] * BLOCK_BYTES


def test_several_client_processes_share_the_requests(tmp_path: Path) -> None:
    server = start_block_server(tmp_path / "server", 500)
    try:
        trace = str(small_trace(tmp_path / "t.jsonl", requests=80))
        args = [
            "replay",
            trace,
            "--url",
            server.url,
            "--clients",
            "3",
            "--block-bytes",
            str(BLOCK_BYTES),
            "--json",
        ]
        result = run_cli(args)
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["clients"] == 3 and document["requests"] == 80
        assert document["corrupt_blocks"] == document["failed_requests"] == 0
        # every block seen before is still in an L1 this large, whichever client stored it
        assert document["hit_blocks"] == document["l1_hit_blocks"]
        assert document["stored_blocks"] + document["hit_blocks"] <= document["blocks"]
    finally:
        assert server.stop() == 0, server.output()


def test_a_server_gone_after_the_last_request_still_gets_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay's own figures were measured; only the server's closing STATUS is lost.
    The report once went with it: one error line, nothing on stdout."""
    from lmcache_tiers.replay import server as server_replay

    server = start_block_server(tmp_path / "server", 500)
    replay_share = server_replay.replay_share

    def share_then_kill_the_server(*args, **kwargs):  # type: ignore[no-untyped-def]
        totals = replay_share(*args, **kwargs)
        server.stop(signal.SIGKILL)  # after its last reply, before the closing STATUS
        return totals

    monkeypatch.setattr(server_replay, "replay_share", share_then_kill_the_server)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=60))
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--timeout", "2"]
    try:
        result = run_cli_in_process([*args, "--json"])
    finally:
        server.stop(signal.SIGKILL)
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["requests"] == 60 and document["failed_requests"] == 0
    assert document["hit_blocks"] > 0 and document["stored_blocks"] > 0
    # what only the server counts is unknown, not zero
    assert document["l1_hit_blocks"] is None and document["server_failures"] is None
    assert document["hit_rate"]["l1_blocks"] is None and document["evicted_blocks"]["l1"] is None
    assert "counters could not be read" in document["stopped"]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: the replay ran its 60 requests but the server's counters could not be read"
    )


def test_a_signal_while_the_servers_counters_settle_keeps_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request was measured; the replay waited (up to --timeout) for the server's L2
    stores to settle before its closing STATUS.  SIGTERM or Ctrl-C then threw the whole
    report away: exit 143, nothing on stdout."""
    from lmcache_tiers.replay import server as server_replay

    server = start_block_server(tmp_path / "server", 500)
    settled = server_replay._settled_status
    waits: list[float] = []

    def signalled_while_settling(probe: Client, timeout_s: float) -> dict[str, object]:
        waits.append(timeout_s)
        if len(waits) == 1:
            signal.raise_signal(signal.SIGTERM)  # a supervisor stops the replay as it waits
        return settled(probe, timeout_s)

    monkeypatch.setattr(server_replay, "_settled_status", signalled_while_settling)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=60))
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--json"]
    try:
        result = run_cli_in_process(args)
    finally:
        assert server.stop() == 0, server.output()
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    document = json.loads(result.stdout)
    assert document["requests"] == 60 and document["failed_requests"] == 0
    # read again at once, within the clean-up bound: the server still answers
    assert len(waits) == 2 and waits[1] <= CLEANUP_TIMEOUT_S, waits
    assert document["l1_hit_blocks"] is not None and document["server_failures"] == {}
    assert document["stopped"].startswith("interrupted (SIGTERM) after 60 of 60 requests")
    assert result.stderr.strip().splitlines()[-1].startswith("error: the replay was interrupted (SIGTERM)")


def test_a_server_that_dies_mid_replay_ends_it_in_one_line(tmp_path: Path) -> None:
    """Without a server, every request left would wait out its --timeout.  What was
    measured until then is reported."""
    server = start_block_server(tmp_path / "server", 500)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=2000))  # 10 s of arrivals
    args = [
        "replay",
        trace,
        "--url",
        server.url,
        "--block-bytes",
        str(BLOCK_BYTES),
        "--timeout",  # every request to the dead server waits it out
        "1",
        "--time-scale",  # paced: the default sends the whole trace as fast as it can
        "1",
        "--json",
    ]
    replay = launch_cli(args)
    try:
        _wait_until_replaying(server, stores=10)
        assert replay.poll() is None, "the replay ended before the server was killed"
        server.stop(signal.SIGKILL)
        out, err = replay.communicate(timeout=120)
    finally:
        replay.kill()
        server.stop(signal.SIGKILL)
    assert replay.returncode == 1, err
    document = json.loads(out)
    assert 10 <= document["requests"] < 2000 and document["failed_requests"] >= 3
    assert document["l1_hit_blocks"] is None and "stopped answering" in document["stopped"]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: replay through {server.url} failed: the server stopped answering: "), err
    assert "3 requests in a row got no reply" in line


def test_l2_stores_still_in_flight_at_the_end_are_counted(tmp_path: Path) -> None:
    # The store controller writes to L2 after the STORE is acknowledged; a report taken
    # the moment the last request is answered left the last batches out.  An L2 taking
    # 10 ms a store falls behind a replay sent as fast as it goes: stores are still queued
    # when the last request is answered.
    server = start_block_server(
        tmp_path / "server", 500, adapters=[{"type": "mock", "max_size_gb": 0.1, "latency_s": 0.01}]
    )
    try:
        trace = str(small_trace(tmp_path / "t.jsonl", requests=60))
        args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--json"]
        result = run_cli_in_process(args)
        assert result.returncode == 0, result.stderr
        document = json.loads(result.stdout)
        assert document["stored_blocks"] > 0 and document["server_failures"] == {}
        assert document["bytes"]["l2_stored"] == document["stored_blocks"] * BLOCK_BYTES
    finally:
        assert server.stop() == 0, server.output()


def _wait_until_replaying(server: ServerProcess, stores: int) -> None:
    """Until the server has taken ``stores`` stores: the replay is under way (a fixed sleep
    says nothing of it on a loaded machine, and idles on a fast one)."""
    deadline = time.monotonic() + 60
    with Client(server.url, timeout=30) as probe:
        while probe.status()["server"]["stores"] < stores:
            assert time.monotonic() < deadline, "the replay stored nothing"
            time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _command_line(process: psutil.Process) -> str:
    """The process's command line, or "" for one that has already ended: a short-lived
    child of the replay can be a zombie by the time it is asked."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:  # ZombieProcess is one
        return ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_client_processes_end_with_the_replay_that_started_them(tmp_path: Path, sig: int) -> None:
    """A replay stopped by a signal to it alone (a supervisor, ``timeout``, ``kill``) ends
    at once and takes its client processes with it; they once replayed on to the end of
    their share (orphans, for SIGTERM) while it waited for them (10 s each, for SIGINT)."""
    server = start_block_server(tmp_path / "server", 500)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=4000))  # 20 s of arrivals
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES)]
    replay = launch_cli([*args, "--clients", "2", "--time-scale", "1", "--json"])
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(workers) < 2:
            assert time.monotonic() < deadline and replay.poll() is None, "no client processes"
            children = psutil.Process(replay.pid).children()
            workers = [child for child in children if "spawn_main" in _command_line(child)]
            time.sleep(0.1)
        _wait_until_replaying(server, stores=10)
        signalled = time.monotonic()
        replay.send_signal(sig)
        while any(_running(worker) for worker in [psutil.Process(replay.pid), *workers]):
            assert time.monotonic() - signalled < 5.0, "the replay or its client processes went on"
            time.sleep(0.1)
        assert replay.wait() == (128 + signal.SIGTERM if sig == signal.SIGTERM else 130)
    finally:
        replay.kill()
        for worker in workers:
            if _running(worker):
                worker.kill()
        server.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    ("clients", "sig"),
    [(1, signal.SIGINT), (2, signal.SIGTERM)],
    ids=["1-client-SIGINT", "2-clients-SIGTERM"],
)
def test_a_replay_stopped_by_a_signal_reports_what_it_measured(
    tmp_path: Path, clients: int, sig: int
) -> None:
    """Ctrl-C on a long replay threw away everything measured: exit 130, no output."""
    server = start_block_server(tmp_path / "server", 500)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=4000))  # 20 s of arrivals
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--time-scale", "1"]
    replay = launch_cli([*args, "--clients", str(clients), "--json"])
    try:
        _wait_until_replaying(server, stores=10)
        replay.send_signal(sig)
        out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
        server.stop(signal.SIGKILL)
    assert replay.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    document = json.loads(out)
    assert 10 <= document["requests"] < 4000 and document["corrupt_blocks"] == 0, err
    assert document["clients"] == clients and document["stored_blocks"] > 0
    name = signal.Signals(sig).name
    assert document["stopped"].startswith(f"interrupted ({name}) after {document['requests']:,} of 4,000")
    # the server still answered: its counters are there
    assert document["l1_hit_blocks"] is not None and document["server_failures"] is not None
    assert err.strip().splitlines()[-1].startswith(f"error: the replay was interrupted ({name}) after"), err


def test_a_replay_stopped_while_it_starts_its_client_processes_ends_cleanly(tmp_path: Path) -> None:
    """A signal while the replay still handed a client process its share (spawning is slow
    on a loaded machine: the first client may be replaying already) cut that hand-over
    short: the half-fed client printed a traceback after the replay's error line, and the
    clients already started were never stopped nor asked for their figures (a report of 0
    requests whatever they had replayed)."""
    server = start_block_server(tmp_path / "server", 500)
    trace = str(small_trace(tmp_path / "t.jsonl", requests=4000))  # 20 s of arrivals
    args = ["replay", trace, "--url", server.url, "--block-bytes", str(BLOCK_BYTES), "--time-scale", "1"]
    replay = launch_cli([*args, "--clients", "2", "--json"])
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while not workers:  # the first client process exists: its share is being handed over
            assert time.monotonic() < deadline and replay.poll() is None, output_of_killed(replay)
            children = psutil.Process(replay.pid).children()
            workers = [child for child in children if "spawn_main" in _command_line(child)]
            time.sleep(0.005)
        replay.send_signal(signal.SIGTERM)
        out, err = replay.communicate(timeout=60)
    finally:
        replay.kill()
        server.stop(signal.SIGKILL)
    assert replay.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert not any(_running(worker) for worker in workers), "a client process outlived the replay"
    document = json.loads(out)
    assert document["clients"] == 2 and document["corrupt_blocks"] == 0
    assert document["stopped"].startswith(f"interrupted (SIGTERM) after {document['requests']:,} of 4,000")
    assert err.strip().splitlines()[-1].startswith("error: the replay was interrupted (SIGTERM) after"), err


def test_an_in_process_replay_stopped_by_sigterm_removes_its_l1_segment(tmp_path: Path) -> None:
    """SIGTERM (a supervisor, ``timeout``) ended the process at once, leaving the L1 arena
    in /dev/shm (one named in --config is never reaped, and refuses the next start)."""
    trace = str(small_trace(tmp_path / "t.jsonl", requests=4000))  # 20 s of arrivals
    name = f"replay_sigterm_{tmp_path.name[-12:]}"
    config = tmp_path / "tiers.toml"
    config.write_text(f'l1_shm_name = "{name}"\n')
    segment = Path("/dev/shm") / name
    args = ["replay", trace, "--in-process", "--l1-blocks", "50", "--block-bytes", str(BLOCK_BYTES)]
    replay = launch_cli([*args, "--config", str(config), "--time-scale", "1", "--json"])
    try:
        deadline = time.monotonic() + 30
        while not segment.exists():
            assert replay.poll() is None, replay.communicate()
            assert time.monotonic() < deadline, (
                f"the replay never made its L1 segment: {output_of_killed(replay)}"
            )
            time.sleep(0.05)
        time.sleep(1.0)  # replaying by now
        replay.send_signal(signal.SIGTERM)
        out, err = replay.communicate(timeout=30)
        assert replay.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err
        assert not segment.exists(), "the L1 segment outlived the replay"
        # what was measured until the signal is reported, said to be partial
        document = json.loads(out)
        assert 0 < document["requests"] < 4000 and document["l1_hit_blocks"] is not None
        assert (
            document["stopped"] == f"interrupted (SIGTERM) after {document['requests']:,} of 4,000 requests"
        )
        assert err.strip().splitlines()[-1] == f"error: the replay was {document['stopped']}", err
    finally:
        replay.kill()
        segment.unlink(missing_ok=True)


def test_a_trace_without_blocks_reports_no_miss_ratio_it_never_measured(tmp_path: Path) -> None:
    # Its hit rate was 0 and its miss ratio 1.0: a cache that missed everything, for a
    # trace that asked for nothing.
    trace = tmp_path / "empty.jsonl"
    line = {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}
    trace.write_text(json.dumps(line) + "\n")
    result = run_cli_in_process(["replay", str(trace), "--simulate", "--json"])
    assert result.returncode == 0, result.stderr
    runs = [run for point in json.loads(result.stdout)["points"] for run in point["runs"]]
    assert runs
    assert {(run["hit_rate"], run["miss_ratio"]) for run in runs} == {(0.0, 0.0)}
    table = run_cli_in_process(["replay", str(trace), "--simulate", "--policy", "LRU"])
    assert table.returncode == 0, table.stderr
    assert "1.0000" not in table.stdout and "n/a" in table.stdout, table.stdout


def test_a_replay_without_blocks_reports_no_hit_rate_it_never_measured(tmp_path: Path) -> None:
    """The replay's table said "0.00% total" for requests that named no block and no
    token, as if the cache had missed everything; the simulation's table says n/a."""
    trace = tmp_path / "empty.jsonl"
    line = {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}
    trace.write_text(json.dumps(line) + "\n")
    result = run_cli_in_process(["replay", str(trace), "--in-process", "--l1-size-gb", "0.01"])
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "prefix hit rate" in line]
    assert len(rows) == 2 and all("n/a" in row and "%" not in row for row in rows), result.stdout


@pytest.mark.parametrize(("fraction", "expected"), [(0.5, 50), (0.99, 99), (1.0, 100), (0.07, 7), (0.0, 1)])
def test_latency_percentiles_are_nearest_rank(fraction: float, expected: int) -> None:
    # int(q * n) as the index made p99 of 100 samples their maximum.
    from lmcache_tiers.replay.run import percentile

    assert percentile([float(value) for value in range(100, 0, -1)], fraction) == expected
