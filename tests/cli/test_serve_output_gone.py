"""`serve` whose stdout reader went away (`serve | head`, a log collector that died): the
banner and the stop summary cannot be shown, which is a warning, never a reason to stop
serving, to skip the stop or to change its exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from thirdparty import CLI, free_port


def _serve_into_a_pipe(tmp_path: Path, *, reader_gone_at_start: bool) -> tuple[int, str]:
    """Runs `serve` with stdout a pipe whose reading end is closed before it starts or
    once it serves; stops it with SIGTERM: (its exit status, its stderr)."""
    shm = f"tiers_output_gone_{uuid.uuid4().hex[:10]}"
    errors = tmp_path / "serve.err"
    read_end, write_end = os.pipe()
    if reader_gone_at_start:
        os.close(read_end)
    command = [*CLI, "serve", "--no-default-l2", "--l1-size-gb", "0.0625", "--shm-name", shm]
    with errors.open("w") as stderr:
        proc = subprocess.Popen(
            [*command, "--port", str(free_port()), "--metrics-port", "0"],
            stdout=write_end,
            stderr=stderr,
        )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 60
        while "serving 0:native" not in errors.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, errors.read_text()
            time.sleep(0.05)
        if not reader_gone_at_start:
            os.close(read_end)
        assert proc.poll() is None, f"serve ended by itself (exit {proc.returncode}): {errors.read_text()}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not os.path.exists(f"/dev/shm/{shm}")
    return code, errors.read_text()


@pytest.mark.parametrize(
    ("reader_gone_at_start", "warning"),
    [
        (True, "the start-up banner could not be shown: BrokenPipeError"),
        (False, "the stop summary could not be shown"),
    ],
    ids=["before-the-banner", "before-the-summary"],
)
def test_a_stdout_nobody_reads_is_a_warning_and_the_stop_exits_as_it_would(
    tmp_path: Path, reader_gone_at_start: bool, warning: str
) -> None:
    code, stderr = _serve_into_a_pipe(tmp_path, reader_gone_at_start=reader_gone_at_start)
    assert code == 0, stderr
    assert warning in stderr, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
