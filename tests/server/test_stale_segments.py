"""L1 segments a killed server left behind, as the next start-up finds them.

A default-named segment (its name carries the creator's pid, and the creator holds a lock
on it for its life) is removed at start-up when its creator is gone, and that removal is
counted in /metrics and named in /status.  A segment under a custom ``--shm-name`` is never
removed: the start-up refuses, and its one line says whether a live server holds the name
or nothing does (a killed server's, or another program's file).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers_e2e import LAUNCHER, ServerProcess, fetch, metric, start_server, stop_cleanly

SMALL_L1 = {"l1_size_gb": 0.0625}
STALE_METRIC = "lmcache_tiers_l1_stale_segments_removed_total"


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory of its own on /dev/shm's tmpfs: only this test's segments are in it."""
    directory = Path(tempfile.mkdtemp(prefix="tiers_stale_", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory)


def _kill(server: ServerProcess) -> None:
    """SIGKILL: the server runs no cleanup, and the kernel drops its creator's lock."""
    server.proc.kill()
    server.proc.wait()


def _start_refused(log_dir: Path, **config: object) -> subprocess.CompletedProcess[str]:
    """Run the server launcher for a start-up expected to fail; its exit code and output."""
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({"config": {"port": 0, "metrics_port": 0, **config}, "adapters": [], "frontends": []})
    return subprocess.run(
        [sys.executable, str(LAUNCHER), spec, str(log_dir / "ready")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )


def _status_table_row(server: ServerProcess, label: str) -> str:
    """The row ``label`` of what ``lmcache-tiers status`` prints for ``server``."""
    table = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "status", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if label in line]
    assert len(rows) == 1, table.stdout
    return rows[0]


def test_a_killed_servers_segment_removed_at_start_is_counted_and_named(
    tmp_path: Path, shm_dir: Path
) -> None:
    killed = start_server(
        tmp_path / "killed", metrics=False, l1_shm_dir=str(shm_dir), l1_shm_name=None, **SMALL_L1
    )
    _kill(killed)
    [left_behind] = [entry.name for entry in shm_dir.iterdir()]

    server = start_server(tmp_path / "next", l1_shm_dir=str(shm_dir), **SMALL_L1)
    try:
        assert not (shm_dir / left_behind).exists()
        assert server.http_url is not None
        status, _, body = fetch(f"{server.http_url}/metrics")
        assert status == 200, body
        assert metric(body, STALE_METRIC) == 1
        _, _, document = fetch(f"{server.http_url}/status")
        assert json.loads(document)["server"]["l1_stale_segments_removed"] == [left_behind]
        assert "removed stale L1 segment" in server.output()
        assert left_behind in _status_table_row(server, "L1 stale segments removed")
    finally:
        stop_cleanly(server)


def test_a_start_that_removed_and_kept_nothing_says_none_in_the_status_table(
    tmp_path: Path, shm_dir: Path
) -> None:
    server = start_server(tmp_path / "clean", l1_shm_dir=str(shm_dir), **SMALL_L1)
    try:
        for label in ("L1 stale segments removed", "L1 stale segments kept"):
            row = _status_table_row(server, label)
            assert row.split(label)[1].strip(" │|") == "none", row
    finally:
        stop_cleanly(server)


def test_a_custom_name_a_live_server_holds_refuses_start_saying_so(tmp_path: Path, shm_dir: Path) -> None:
    live = start_server(tmp_path / "live", metrics=False, l1_shm_dir=str(shm_dir), **SMALL_L1)
    try:
        refused = _start_refused(
            tmp_path / "second", l1_shm_dir=str(shm_dir), l1_shm_name=live.shm_name, **SMALL_L1
        )
        assert refused.returncode == 2, refused.stderr
        assert "a live server holds it" in refused.stderr
        assert "nothing holds it" not in refused.stderr
        assert live.shm_path.exists()
    finally:
        stop_cleanly(live)


def test_a_custom_name_a_killed_server_left_refuses_start_and_stays(tmp_path: Path, shm_dir: Path) -> None:
    killed = start_server(tmp_path / "killed", metrics=False, l1_shm_dir=str(shm_dir), **SMALL_L1)
    _kill(killed)
    assert killed.shm_path.exists()

    refused = _start_refused(
        tmp_path / "next", l1_shm_dir=str(shm_dir), l1_shm_name=killed.shm_name, **SMALL_L1
    )
    assert refused.returncode == 2, refused.stderr
    assert "nothing holds it: left by a server that was killed" in refused.stderr
    assert f"remove {killed.shm_path} if it is this server's" in refused.stderr
    assert "a live server holds it" not in refused.stderr
    # Fail closed: the file could be another program's, so it is never removed for it.
    assert killed.shm_path.exists()


# What a server of 28c5b5b does with its segment: maps it for its whole life,
# with no creator's lock on it.
_MAP_WITHOUT_LOCK = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
segment = mmap.mmap(fd, os.fstat(fd).st_size)
print("mapped", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _mapped_without_lock(path: Path) -> Iterator[int]:
    """A process mapping ``path`` as a 28c5b5b server does, for the block; its pid."""
    earlier = subprocess.Popen(
        [sys.executable, "-c", _MAP_WITHOUT_LOCK, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert earlier.stdout is not None and earlier.stdout.readline() == "mapped\n"
        yield earlier.pid
    finally:
        earlier.communicate("")


def test_a_custom_name_an_earlier_release_server_maps_refuses_start_without_advising_removal(
    tmp_path: Path, shm_dir: Path
) -> None:
    path = shm_dir / "earlier_release_segment"
    path.write_bytes(b"\0" * (1 << 20))
    with _mapped_without_lock(path) as earlier:
        refused = _start_refused(
            tmp_path / "next", l1_shm_dir=str(shm_dir), l1_shm_name=path.name, **SMALL_L1
        )
    assert refused.returncode == 2, refused.stderr
    assert f"process {earlier} maps it" in refused.stderr
    assert "nothing holds it" not in refused.stderr
    assert "remove" not in refused.stderr
    assert path.exists()


_NAME_TAKEN = """
import sys
from lmcache_tiers.l1.segment import _name_taken
print(_name_taken(sys.argv[1]))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs the start-up's check as another user"
)
def test_a_segment_mapped_by_another_user_s_process_is_not_advised_for_removal(shm_dir: Path) -> None:
    """A server started by one user cannot read another user's /proc/<pid>/maps: a live
    earlier-release server of that user (no creator's lock) is invisible to the scan, so
    the refusal must not call its segment a killed server's and advise removing it."""
    shm_dir.chmod(0o755)
    path = shm_dir / "other_users_segment"
    path.write_bytes(b"\0" * (1 << 20))
    path.chmod(0o644)
    with _mapped_without_lock(path):
        checked = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                _NAME_TAKEN,
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert checked.returncode == 0, checked.stderr
        said = checked.stdout
        assert "nothing holds it: left by a server that was killed" not in said
        assert "could not be read" in said
        assert path.exists()


def test_a_default_named_segment_a_live_process_maps_is_not_removed_at_start(shm_dir: Path) -> None:
    """A 28c5b5b server in a container sharing /dev/shm but not the pid namespace names its
    segment with a pid this start-up cannot see (or one a different process has here), and
    takes no creator's lock: where its process is visible by another pid (the host's view
    of a container), its mapping is what shows the segment is live."""
    from lmcache_tiers.l1.arena import remove_stale_segments

    unseen_pid = 4_194_000  # above every Linux pid_max: no process here has it
    path = shm_dir / f"lmcache_tiers_{unseen_pid}_0123abcd"
    path.write_bytes(b"\0" * (1 << 20))
    with _mapped_without_lock(path):
        assert remove_stale_segments(str(shm_dir)) == []
        assert path.exists()
    # once nothing maps it, it is a killed server's file like any other
    assert remove_stale_segments(str(shm_dir)) == [path.name]


_REMOVE_STALE = """
import logging, sys
from lmcache_tiers.l1.arena import remove_stale_segments
logging.basicConfig(level=logging.INFO)
print(remove_stale_segments(sys.argv[1]))
"""

_NOBODY = 65534


def _remove_stale_as_nobody(directory: Path) -> subprocess.CompletedProcess[str]:
    """The start-up clean-up of ``directory`` run by a server of uid 65534 (not root)."""
    return subprocess.run(
        [
            *("setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"),
            *(sys.executable, "-c", _REMOVE_STALE, str(directory)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="runs the clean-up as another user"
)
def test_a_non_root_start_keeps_its_users_segment_a_root_process_maps_and_removes_it_once_unmapped(
    shm_dir: Path,
) -> None:
    """A server of uid 65534 cannot read root's /proc/<pid>/maps, and root may map a 0600
    segment of any user: such a mapping, unseen in the maps, must still keep the file
    (with one line why), while root's unreadable processes alone must not stop the
    clean-up of a segment nothing uses."""
    shm_dir.chmod(0o1777)  # as /dev/shm: anyone creates, only the owner removes
    unseen_pid = 4_194_000  # above every Linux pid_max: no process here has it
    path = shm_dir / f"lmcache_tiers_{unseen_pid}_0123abcd"
    path.write_bytes(b"\0" * (1 << 20))
    os.chown(path, _NOBODY, _NOBODY)
    path.chmod(0o600)
    with _mapped_without_lock(path):  # as root
        kept = _remove_stale_as_nobody(shm_dir)
        assert kept.returncode == 0, kept.stderr
        assert kept.stdout.strip() == "[]", kept.stderr
        assert path.exists()
        assert "left in place: another process has it open or mapped" in kept.stderr
    removed = _remove_stale_as_nobody(shm_dir)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == f"[{path.name!r}]", removed.stderr
    assert not path.exists()


KEPT_METRIC = "lmcache_tiers_l1_stale_segments_kept_total"


def test_a_leftover_segment_start_up_keeps_is_counted_and_named(tmp_path: Path, shm_dir: Path) -> None:
    """A segment named with a pid this start-up cannot see but that a live process maps is
    left in place: an operator sees it in /metrics and /status, not only in a log line."""
    unseen_pid = 4_194_001  # above every Linux pid_max: no process here has it
    kept = shm_dir / f"lmcache_tiers_{unseen_pid}_0123abce"
    kept.write_bytes(b"\0" * (1 << 20))
    with _mapped_without_lock(kept):
        server = start_server(tmp_path / "next", l1_shm_dir=str(shm_dir), **SMALL_L1)
    try:
        assert kept.exists()
        assert server.http_url is not None
        status, _, body = fetch(f"{server.http_url}/metrics")
        assert status == 200, body
        assert metric(body, KEPT_METRIC) == 1
        assert metric(body, STALE_METRIC) == 0
        _, _, document = fetch(f"{server.http_url}/status")
        assert json.loads(document)["server"]["l1_stale_segments_kept"] == [kept.name]
        assert f"L1 segment {kept} of process {unseen_pid} left in place" in server.output()
        assert kept.name in _status_table_row(server, "L1 stale segments kept")
    finally:
        stop_cleanly(server)
