"""An in-process replay that ran to its end and whose storage close then failed: the report
the user waited for is shown, then one error line naming the close failure, exit code 1 (a
failure at the end, not the usage error of exit code 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from replay_helpers import BLOCK_BYTES, small_trace
from thirdparty import pip_install_to, run_cli, write_package

FAILING_CLOSE = '''
from lmcache_tiers.plugin import L2AdapterConfig, hookimpl


class FailingCloseConfig(L2AdapterConfig):
    """Objects in memory; the backend's close raises."""


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("failing_close_mem", "failing_close_tiers.impl:FailingCloseBackend", FailingCloseConfig)
'''

FAILING_CLOSE_IMPL = """
class FailingCloseBackend:
    def __init__(self, config, context):
        self.objects = {}

    def put_many(self, keys, payloads):
        for key, payload in zip(keys, payloads):
            self.objects[key] = bytes(payload)
        return [True] * len(keys)

    def contains_many(self, keys):
        return [len(self.objects[key]) if key in self.objects else None for key in keys]

    def get_many_into(self, keys, buffers):
        for key, buffer in zip(keys, buffers):
            buffer[:] = self.objects[key]
        return [True] * len(keys)

    def delete_many(self, keys):
        return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self):
        return [(key, len(value)) for key, value in list(self.objects.items())]

    def capacity(self):
        return None

    def close(self):
        raise OSError("the device went away")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pkgs")
    target = root / "site"
    package = write_package(
        root, "failing-close-tiers", "failing_close_tiers", FAILING_CLOSE, {"impl": FAILING_CLOSE_IMPL}
    )
    pip_install_to(target, package)
    return target


def _replay(tmp_path: Path, site: Path, *extra: str):  # type: ignore[no-untyped-def]
    trace = str(small_trace(tmp_path / "t.jsonl"))
    args = [
        "replay",
        trace,
        "--in-process",
        "--l1-blocks",
        "20",
        "--block-bytes",
        str(BLOCK_BYTES),
        "--l2-adapter",
        '{"type": "failing_close_mem"}',
        *extra,
    ]
    return run_cli(args, site=site)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


def test_a_failed_close_after_the_replay_shows_the_report_then_exits_1(tmp_path: Path, site: Path) -> None:
    result = _replay(tmp_path, site, "--json")
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    assert document["mode"] == "in-process" and document["requests"] == 60
    line = _last_line(result.stderr)
    assert line.startswith("error: the replay ran to its end but closing its storage failed"), line
    assert "the device went away" in line


def test_the_table_report_comes_before_the_error_line(tmp_path: Path, site: Path) -> None:
    result = _replay(tmp_path, site)
    assert result.returncode == 1, result.stderr
    assert "hit" in result.stdout.lower(), result.stdout
    assert "closing its storage failed" in _last_line(result.stderr)


# Run as the replay's main script: SIGTERM (a supervisor) comes as the StorageManager of a
# replay that ran to its end begins to close; a marker file says whether that close ran
# to its end (the adapters closed, the L1 arena released).
_SIGNALLED_CLOSE_REPLAY = """
import os, signal, sys
from pathlib import Path

from lmcache_tiers.storage import StorageManager

_close = StorageManager.close


def _signalled_close(self, *args, **kwargs):
    signal.raise_signal(signal.SIGTERM)  # the first signal, once the replay is over
    _close(self, *args, **kwargs)
    Path(os.environ["CLOSED_MARKER"]).write_text("closed")


StorageManager.close = _signalled_close

if __name__ == "__main__":
    from lmcache_tiers.cli.main import main

    sys.argv = ["lmcache-tiers", *sys.argv[1:]]
    main()
"""


def _replay_with_close(tmp_path: Path, script_text: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """An in-process replay run by ``script_text`` (which replaces StorageManager.close);
    the process and the marker file its close writes."""
    script = tmp_path / "signalled_close_replay.py"
    script.write_text(script_text)
    marker = tmp_path / "closed"
    trace = str(small_trace(tmp_path / "t.jsonl", requests=20))
    args = ["replay", trace, "--in-process", "--l1-blocks", "50", "--block-bytes", str(BLOCK_BYTES), "--json"]
    environment = {**os.environ, "CLOSED_MARKER": str(marker)}
    replay = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120, env=environment
    )
    return replay, marker


def test_a_signal_while_the_storage_closes_lets_the_close_finish_then_exits_143(tmp_path: Path) -> None:
    # The signal used to raise inside the close: its steps (joining the controllers,
    # closing the adapters, releasing L1) were skipped, not merely cut short.
    replay, marker = _replay_with_close(tmp_path, _SIGNALLED_CLOSE_REPLAY)
    assert replay.returncode == 128 + signal.SIGTERM, replay.stderr
    assert marker.read_text() == "closed", replay.stderr
    assert "Traceback" not in replay.stderr, replay.stderr
    # The replay had measured every request: the report once went with the signal.
    document = json.loads(replay.stdout)
    assert document["requests"] == 20 and document["l1_hit_blocks"] is not None
    assert document["stopped"] == "interrupted (SIGTERM) while its storage closed, after all 20 requests"
    assert replay.stderr.strip().splitlines()[-1] == f"error: the replay was {document['stopped']}"


# A second signal (Ctrl-C) comes while the close the first one waits for has not returned
# (a close that hangs): the marker says what the second signal raised inside the close.
_TWICE_SIGNALLED_CLOSE_REPLAY = _SIGNALLED_CLOSE_REPLAY.replace(
    """    signal.raise_signal(signal.SIGTERM)  # the first signal, once the replay is over
    _close(self, *args, **kwargs)
    Path(os.environ["CLOSED_MARKER"]).write_text("closed")
""",
    """    signal.raise_signal(signal.SIGTERM)  # the first signal, once the replay is over
    try:
        signal.raise_signal(signal.SIGINT)  # the user gives up waiting
    except BaseException as forced:
        Path(os.environ["CLOSED_MARKER"]).write_text(type(forced).__name__)
        _close(self, *args, **kwargs)  # not the replay's own: the test leaves no L1 arena behind
        raise
    _close(self, *args, **kwargs)
""",
)


def test_a_second_signal_while_the_storage_closes_forces_the_exit_at_once(tmp_path: Path) -> None:
    # The second signal used to be swallowed as the first was held: a close that hung
    # could not be left short of SIGKILL.  Now it hands the held SIGTERM on at once.
    assert _TWICE_SIGNALLED_CLOSE_REPLAY != _SIGNALLED_CLOSE_REPLAY
    replay, marker = _replay_with_close(tmp_path, _TWICE_SIGNALLED_CLOSE_REPLAY)
    assert replay.returncode == 128 + signal.SIGTERM, replay.stderr
    assert marker.read_text() == "SystemExit", replay.stderr
    assert "SIGINT came again while the replay's storage closes" in replay.stderr, replay.stderr
    assert json.loads(replay.stdout)["requests"] == 20, replay.stdout  # still reported
