"""A stop or a failed start-up whose clean-up meets a failure or a signal: every resource
(L1 segment, HTTP port, wake-up pipe) is still released, and ``run_server`` ends on one
clear line rather than a traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_tiers.config import ServerConfig
from lmcache_tiers.server import app
from lmcache_tiers.server.app import StopFailed, TiersServer, run_server
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.ports import free_port


@contextlib.contextmanager
def _ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C handled as Python's default for the block: a suite started in the background
    (a non-interactive shell's ``cmd &``) inherits SIGINT ignored, which ``run_server`` then
    keeps ignored by design -- and a test sending itself SIGINT would wait for ever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _join_is_broken() -> bool:
    raise RuntimeError("join is broken")


def _break_the_store_join(monkeypatch: pytest.MonkeyPatch, server: TiersServer) -> None:
    """The store controller's join raises: the storage's close goes on with its other steps
    (stopping the other threads, closing the adapters and L1) and then raises."""
    monkeypatch.setattr(server.storage.store, "join", _join_is_broken)


@contextlib.contextmanager
def _segment(name: str) -> Iterator[str]:
    path = f"/dev/shm/{name}"
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _same_pipe(fd: int, identity: tuple[int, int]) -> bool:
    try:
        status = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISFIFO(status.st_mode) and (status.st_dev, status.st_ino) == identity


def _stop_controllers(server: TiersServer) -> None:
    """A join of the storage's close failed: make sure every thread ended, for the next test."""
    for controller in server.storage._parts.controllers():
        controller.stop(0.0)


def test_a_storage_close_that_raises_still_releases_everything(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    http_port = free_port()
    config = ServerConfig(port=0, metrics_port=http_port, l1_size_gb=0.0625, l1_shm_name=name)
    with _segment(name) as segment:
        server = TiersServer(config)
        pipe = os.fstat(server._wake_read)
        pipe_fd, pipe_identity = server._wake_read, (pipe.st_dev, pipe.st_ino)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        server.request_stop()
        thread.join(30)
        assert not thread.is_alive()
        _break_the_store_join(monkeypatch, server)
        try:
            with caplog.at_level(logging.ERROR, logger="lmcache_tiers"), pytest.raises(StopFailed) as failed:
                server.close()
        finally:
            monkeypatch.undo()
            _stop_controllers(server)
        assert "closing the storage failed: joining l2-store failed: RuntimeError: join is broken" in str(
            failed.value
        )
        assert not os.path.exists(segment), "the L1 segment outlived the failed close"
        assert _port_is_free(http_port), "the HTTP endpoint outlived the failed close"
        assert not _same_pipe(pipe_fd, pipe_identity), "the wake-up pipe outlived the failed close"
        # the raise is in the log, with its traceback, once: the storage's close logged it,
        # the server names it in StopFailed without logging it (or a traceback) again
        assert caplog.text.count("RuntimeError: join is broken") == 1
        assert caplog.text.count("Traceback (most recent call last)") == 1
        assert caplog.text.count("joining l2-store failed; the close goes on") == 1


def _stop_once_ready(ready: threading.Event, returned: threading.Event) -> threading.Thread:
    def stop() -> None:
        if ready.wait(30) and not returned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    return stopper


def _serve_until_a_sigterm(monkeypatch: pytest.MonkeyPatch, closed: list[TiersServer]) -> tuple[int, bool]:
    """``run_server`` on a fresh L1 segment, sent SIGTERM once it serves: its exit code and
    whether its segment outlived it.  The test's patches are undone as it returns and the
    threads of every server in ``closed`` (whose storage close a patch broke) stopped."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name)
    ready, returned = threading.Event(), threading.Event()
    stopper = _stop_once_ready(ready, returned)
    with _segment(name) as segment:
        try:
            code = run_server(config, ready=ready, banner=False)
        finally:
            returned.set()
            ready.set()
            stopper.join(5)
            monkeypatch.undo()
            for server in closed:
                _stop_controllers(server)
        return code, os.path.exists(segment)


def test_serve_ends_a_failed_stop_on_one_line_with_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    closes: list[TiersServer] = []
    close = TiersServer.close

    def close_with_a_broken_join(self: TiersServer, console: Any = None) -> dict[str, Any]:
        closes.append(self)
        _break_the_store_join(monkeypatch, self)
        return close(self, console)

    monkeypatch.setattr(TiersServer, "close", close_with_a_broken_join)
    code, segment_left = _serve_until_a_sigterm(monkeypatch, closes)
    assert code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: the stop failed: closing the storage failed: "
        "joining l2-store failed: RuntimeError: join is broken; "
        "0 objects acknowledged to clients were not stored in L2"
    ]
    assert not segment_left


def test_a_first_signal_does_not_cut_short_the_clean_up_of_a_failed_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The start-up fails (a front end that cannot be built); a Ctrl-C arriving while what
    was built is closed waits for that clean-up, which unlinks the segment."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name)

    def broken_frontend(*args: object, **kwargs: object) -> None:
        raise RuntimeError("front end is broken")

    close = StorageManager.close

    def close_after_a_ctrl_c(self: StorageManager, drain_timeout_s: float = 10.0) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this thread before the next line
        close(self, drain_timeout_s)

    monkeypatch.setattr(app, "create_frontend", broken_frontend)
    monkeypatch.setattr(StorageManager, "close", close_after_a_ctrl_c)
    with _segment(name) as segment, _ctrl_c_raises():
        code = run_server(config, banner=False)
        monkeypatch.undo()
        assert not os.path.exists(segment), "the L1 segment outlived the failed start-up's clean-up"
        # the outcome is the start-up's failure, not the signal's
        assert code == 1
        assert "cannot start the server: RuntimeError: front end is broken" in capsys.readouterr().err


class _Notices(logging.Handler):
    """Sets ``seen`` once a log record holding ``text`` is emitted (from any thread)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def test_a_signal_waiting_for_a_start_up_handling_an_error_is_logged_when_it_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start-up step that retries inside an ``except`` block (a plugin reconnecting) keeps
    a first Ctrl-C waiting; the operator is told so while it waits, not only afterwards, and
    learns that a second one stops at once.  The start-up then ends on the signal."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    name = f"tiers_unit_{uuid.uuid4().hex[:12]}"
    config = ServerConfig(port=0, metrics_port=0, l1_size_gb=0.0625, l1_shm_name=name)
    notices = _Notices("send it again to stop at once")
    told_while_waiting: list[bool] = []
    build = app.create_frontend

    def frontend_built_after_a_retry(*args: Any, **kwargs: Any) -> Any:
        try:
            raise ConnectionRefusedError("not up yet")
        except ConnectionRefusedError:
            os.kill(os.getpid(), signal.SIGINT)  # delivered to this thread before the next line
            told_while_waiting.append(notices.seen.wait(timeout=20.0))
        return build(*args, **kwargs)

    monkeypatch.setattr(app, "create_frontend", frontend_built_after_a_retry)
    logging.getLogger().addHandler(notices)
    try:
        with _segment(name) as segment, _ctrl_c_raises():
            code = run_server(config, banner=False)
            monkeypatch.undo()
            assert not os.path.exists(segment)
    finally:
        logging.getLogger().removeHandler(notices)
    assert told_while_waiting == [True], "the waiting signal was not logged while it waited"
    assert code == 128 + signal.SIGINT


def _count_writes_given_up(server: TiersServer, objects: int) -> None:
    """The storage counts ``objects`` acknowledged writes as dropped at the stop, as its
    close does for stores still queued when a second signal cuts the drain."""
    server.storage._parts.stats.fail("l2_store_dropped_at_shutdown", objects)


def test_a_failed_stop_that_lost_acknowledged_writes_exits_3_not_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lost data must not hide behind a generic failure: a supervisor that alerts on 3
    would miss writes lost by a stop that also failed a step."""
    closes: list[TiersServer] = []
    close = TiersServer.close

    def close_losing_writes_with_a_broken_join(self: TiersServer, console: Any = None) -> dict[str, Any]:
        closes.append(self)
        _count_writes_given_up(self, 2)
        _break_the_store_join(monkeypatch, self)
        return close(self, console)

    monkeypatch.setattr(TiersServer, "close", close_losing_writes_with_a_broken_join)
    code, segment_left = _serve_until_a_sigterm(monkeypatch, closes)
    assert code == app.EXIT_ACKNOWLEDGED_WRITES_LOST
    assert not segment_left
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "joining l2-store failed" in lines[0]
    assert lines[0].endswith("; 2 objects acknowledged to clients were not stored in L2")


def test_a_front_end_failure_whose_stop_lost_acknowledged_writes_exits_3_not_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve = TiersServer.serve

    def serve_then_fail(self: TiersServer) -> None:
        serve(self)
        raise RuntimeError("a front end's bug")

    def close_losing_writes(self: TiersServer, console: Any = None) -> dict[str, Any]:
        _count_writes_given_up(self, 2)
        return close(self, console)

    close = TiersServer.close
    monkeypatch.setattr(TiersServer, "serve", serve_then_fail)
    monkeypatch.setattr(TiersServer, "close", close_losing_writes)
    code, segment_left = _serve_until_a_sigterm(monkeypatch, [])
    assert code == app.EXIT_ACKNOWLEDGED_WRITES_LOST
    assert not segment_left
