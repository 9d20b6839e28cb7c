"""``status``, ``bench`` and ``replay --url`` against a server that does not answer (yet): a note on
stderr within a couple of seconds, then either the run (the server came up) or one error
line and exit code 1 when ``--timeout`` is over; Ctrl-C meanwhile exits with 130.

Each test runs the commands it compares at the same time, to keep the suite short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from replay_helpers import small_trace
from thirdparty import CLI, ServerProcess, free_port, launch_serve
from tiers_e2e import stop_signals_at_default

#: generous: a loaded machine may take a while to import the CLI and start a server
DEADLINE_S = 90.0
#: the note is due after about two seconds; this is only how long a test waits for it
NOTE_DEADLINE_S = 30.0


class Running:
    """A CLI command in a subprocess whose stderr is collected line by line as it comes."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = log_dir / "stdout.txt"
        self.proc = subprocess.Popen(
            [*CLI, *args],
            stdout=self.stdout_path.open("wb"),
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            # a test run with SIGINT ignored passes that on: the command would miss the Ctrl-C
            preexec_fn=stop_signals_at_default(),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, start: str) -> str:
        deadline = time.monotonic() + NOTE_DEADLINE_S
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(start):
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no stderr line starting {start!r}; stderr: {self.lines}")

    def finish(self) -> tuple[int, str, list[str]]:
        """Exit code, stdout and the non-empty stderr lines."""
        try:
            code = self.proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {DEADLINE_S:g}s; stderr: {self.lines}") from None
        self._reader.join(10)
        return code, self.stdout_path.read_text(), [line for line in self.lines if line.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


Launch = Callable[[dict[str, list[str]]], dict[str, Running]]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    """Start commands side by side (name -> CLI arguments); any still running at the end
    of the test (it failed) is killed."""
    started: list[Running] = []

    def start(commands: dict[str, list[str]]) -> dict[str, Running]:
        running = {name: Running(args, tmp_path / name) for name, args in commands.items()}
        started.extend(running.values())
        return running

    yield start
    for command in started:
        command.kill()


def _commands(url: str, trace: Path, timeout: float) -> dict[str, list[str]]:
    """Tiny runs of the commands."""
    return {
        "status": ["status", "--url", url, "--timeout", f"{timeout:g}", "--json"],
        "bench": [
            "bench",
            "--url",
            url,
            "--timeout",
            f"{timeout:g}",
            "--chunks",
            "2",
            "--chunk-mib",
            "0.0625",
            "--repeats",
            "1",
            "--lookup-requests",
            "20",
            "--json",
        ],
        "replay": ["replay", str(trace), "--url", url, "--timeout", f"{timeout:g}", "--json"],
    }


def _serve(port: int, log_dir: Path) -> ServerProcess:
    """``lmcache-tiers serve`` on ``port`` with a small L1 only; not waited for: the
    commands under test do the waiting."""
    return launch_serve(["--l1-size-gb", "0.125", "--no-default-l2"], None, log_dir, port=port)


def test_no_server_is_a_note_then_one_error_line_at_the_timeout(tmp_path: Path, launch: Launch) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    running = launch(_commands(url, trace, 4.0))
    for name, command in running.items():
        code, stdout, lines = command.finish()
        assert code == 1, (name, lines)
        assert stdout.strip() == "", (name, stdout)
        assert not any("Traceback" in line for line in lines), (name, lines)
        assert len(lines) == 2, (name, lines)
        note, error = lines
        assert note.startswith(f"note: no answer from {url} yet"), (name, note)
        assert "more (--timeout 4)" in note, (name, note)
        failed = {
            "status": f"cannot get the status of {url}",
            "bench": f"benchmark of {url} failed",
            "replay": f"replay through {url} failed",
        }[name]
        assert error == (
            f"error: {failed}: no answer within --timeout 4 s: is the server running, with a native "
            "front end listening there? (an lmcache_mp front end does not answer this command)"
        ), (name, error)


def test_ctrl_c_while_waiting_exits_like_any_interrupt(tmp_path: Path, launch: Launch) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    trace = small_trace(tmp_path / "t.jsonl", requests=4)
    running = launch(_commands(url, trace, 300.0))
    for command in running.values():
        command.wait_for_line("note: no answer from")
        command.proc.send_signal(signal.SIGINT)
    for name, command in running.items():
        code, _stdout, lines = command.finish()
        assert code == 130, (name, lines)
        assert lines[0].startswith("note: no answer from"), (name, lines)
        # replay says what the signal cut short (status and bench have nothing to report but
        # the stop itself, as for SIGTERM)
        said = f"error: interrupted (SIGINT) while waiting for the server at {url}; nothing was replayed"
        assert lines[1:] == ([said] if name == "replay" else ["error: stopped by SIGINT"]), (name, lines)


def test_a_server_that_comes_up_while_they_wait_is_used(tmp_path: Path, launch: Launch) -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    trace = small_trace(tmp_path / "t.jsonl", requests=6)
    running = launch(_commands(url, trace, 60.0))
    for command in running.values():
        command.wait_for_line("note: no answer from")
    server = _serve(port, tmp_path / "server")
    try:
        for name, command in running.items():
            code, stdout, lines = command.finish()
            assert code == 0, (name, lines, server.output())
            assert len(lines) == 1 and lines[0].startswith(f"note: no answer from {url} yet"), (name, lines)
            assert stdout.lstrip().startswith("{"), (name, stdout)  # the --json document
    finally:
        assert server.stop(signal.SIGINT) == 0, server.output()
