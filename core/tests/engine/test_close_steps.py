"""Every step of the storage's close runs whatever an earlier one raised: a controller
whose stop or join fails still leaves the other threads stopped, the adapters closed, L1
released and the store's unstored writes counted; the close then raises one error naming
what failed, each failure logged once with its traceback."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import pytest
from engine_support import GatedStorePolicy, MiB, keys_of, mock, store

from lmcache_tiers import storage_wiring
from lmcache_tiers.controllers import base
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.storage import StorageCloseFailed

DROPPED = ("l2_store_abandoned", "l2_store_dropped_at_shutdown")
BROKEN = 'raise RuntimeError(f"{self.name}: {step} is broken")'


def dropped(failures: dict[str, int]) -> int:
    return sum(failures.get(reason, 0) for reason in DROPPED)


def break_step(monkeypatch: pytest.MonkeyPatch, controller: base.ControllerThread, step: str) -> None:
    class Broken:
        name = controller.name

        def __call__(self, *args: object) -> bool:
            raise RuntimeError(f"{self.name}: {step} is broken")

    monkeypatch.setattr(controller, step, Broken())


@pytest.mark.parametrize("broken", ["prefetch", "store", "l1_eviction"])
@pytest.mark.parametrize("step", ["join", "request_stop"])
def test_a_controller_whose_stop_step_raises_leaves_the_rest_of_the_close_to_run(
    engine, monkeypatch, caplog, broken: str, step: str
) -> None:
    monkeypatch.setattr(base, "JOIN_GRACE_S", 0.2)
    storage = engine([mock(), mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # the store controller's step stalls in its policy
    stalled, queued = keys_of(1, 3), keys_of(2, 2)
    store(storage, stalled, MiB)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    store(storage, queued, MiB)  # behind the stalled batch, in the queue
    controller = getattr(storage, broken)
    break_step(monkeypatch, controller, step)

    with caplog.at_level(logging.ERROR, logger="lmcache_tiers"), pytest.raises(StorageCloseFailed) as failed:
        storage.close(drain_timeout_s=0.0)

    assert f"{controller.name}: {step} is broken" in str(failed.value)
    assert all(adapter.closed for adapter in storage.adapters), "an adapter outlived the failed close"
    assert storage.l1.closed, "L1 outlived the failed close"
    # Left behind in its step (or never joined): the close counted its writes, all of them.
    assert dropped(storage.failures()) == len(stalled) + len(queued)
    # Logged once, with its traceback.
    assert caplog.text.count(BROKEN) == 1
    others = [c for c in storage._parts.controllers() if c is not controller and c is not storage.store]
    assert not any(other._thread.is_alive() for other in others), "a controller outlived the close"

    monkeypatch.undo()
    GatedStorePolicy.gate.set()
    controller.stop(0.0)  # the broken one (its stop may never have been asked)
    storage.store._thread.join(30)
    assert dropped(storage.failures()) == len(stalled) + len(queued), "counted again by the late step"


def test_a_close_whose_steps_all_pass_raises_nothing_and_counts_what_it_dropped(engine) -> None:
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()
    store(storage, keys_of(1, 2), MiB)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    GatedStorePolicy.gate.set()
    storage.close(drain_timeout_s=10.0)
    assert storage.l1.closed
    assert dropped(storage.failures()) == 0


def test_a_backend_whose_close_raises_fails_the_close_and_is_counted(engine, monkeypatch, caplog) -> None:
    # A backend's close left undone (a last checkpoint) may bring deleted objects back at
    # the next start: counted among the failures and failing the stop, not only logged.
    storage = engine([mock(), mock()])
    failing, other = storage.adapters

    def close() -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(failing.backend, "close", close, raising=False)
    with caplog.at_level(logging.ERROR, logger="lmcache_tiers"), pytest.raises(StorageCloseFailed) as failed:
        storage.close(drain_timeout_s=0.0)

    assert f"closing L2 adapter {failing.name} failed" in str(failed.value)
    assert "OSError: [Errno 5] Input/output error" in str(failed.value)
    assert storage.failures().get("l2_backend_close_failed") == 1
    logged = [record for record in caplog.records if "Input/output error" in record.getMessage()]
    assert len(logged) == 1, "logged once, by the close's step, with the backend's traceback"
    assert "closing the backend failed" in logged[0].getMessage()
    assert other.closed and storage.l1.closed


@contextlib.contextmanager
def closing_past_its_budget(monkeypatch: pytest.MonkeyPatch, adapter: BackendAdapter) -> Iterator[None]:
    """Within the block, ``adapter``'s backend close does not return within its budget
    (cut to 0.2 s); it returns once the block is left, so that no thread outlives the test."""
    gate = threading.Event()
    monkeypatch.setattr(adapter.backend, "close", lambda: gate.wait(60), raising=False)
    monkeypatch.setattr(adapter, "close_backend_timeout_s", 0.2)
    try:
        yield
    finally:
        gate.set()


def test_a_backend_whose_close_does_not_return_fails_the_close_and_is_counted(
    engine, monkeypatch, caplog
) -> None:
    # A close left running past its budget (removing files on a hung mount, a last flush
    # to a peer that stopped answering) may have left as much undone as one that raised:
    # the stop fails the same way, naming the adapter and the budget, not exit 0.
    storage = engine([mock(), mock()])
    hung, other = storage.adapters
    with (
        closing_past_its_budget(monkeypatch, hung),
        caplog.at_level(logging.WARNING, logger="lmcache_tiers"),
        pytest.raises(StorageCloseFailed) as failed,
    ):
        storage.close(drain_timeout_s=0.0)

    assert f"closing L2 adapter {hung.name} failed" in str(failed.value)
    assert "close did not return in 0.2 s" in str(failed.value)
    assert hung.stats()["backend_close_timeouts"] == 1
    assert hung.stats().get("backend_close_failures", 0) == 0, "a timeout, not a raise"
    assert storage.failures().get("l2_backend_close_failed") == 1
    assert "close of the backend did not return" in caplog.text
    assert other.closed and storage.l1.closed


def test_a_failed_close_on_leaving_a_with_block_does_not_hide_what_ended_the_block(
    engine, monkeypatch, caplog
) -> None:
    # An in-process replay stopped by SIGTERM (SystemExit 143) leaves its `with
    # StorageManager` block: a close that then fails (a backend's close past its budget)
    # is counted and logged, and the replay still exits 143, not with the close's error.
    storage = engine([mock()])
    (hung,) = storage.adapters
    with (
        closing_past_its_budget(monkeypatch, hung),
        caplog.at_level(logging.ERROR, logger="lmcache_tiers"),
        pytest.raises(SystemExit) as ended,
        storage,
    ):
        raise SystemExit(143)

    assert ended.value.code == 143
    assert storage.failures().get("l2_backend_close_failed") == 1
    assert f"closing L2 adapter {hung.name} failed" in caplog.text
    assert storage.l1.closed


def test_a_failed_close_on_leaving_a_with_block_that_ended_well_raises(engine, monkeypatch) -> None:
    storage = engine([mock()])
    (broken,) = storage.adapters
    monkeypatch.setattr(broken.backend, "close", _close_is_broken, raising=False)
    with pytest.raises(StorageCloseFailed, match=f"closing L2 adapter {broken.name} failed"), storage:
        pass


def _close_is_broken() -> None:
    raise OSError("checkpoint not written")


def test_a_close_failing_after_a_failed_start_is_one_error_line_without_a_traceback(caplog) -> None:
    # The start's own error is what the operator reads; the close's (a file it could not
    # remove) is one line beside it, its traceback at debug only.
    class Adapter:
        name = "0:fs"

        def close(self) -> None:
            raise PermissionError(1, "Operation not permitted", "/srv/l2/x.bin")

    with caplog.at_level(logging.DEBUG, logger="lmcache_tiers"):
        storage_wiring._close_logging_failure(Adapter())  # type: ignore[arg-type]
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [record.getMessage() for record in errors] == [
        "closing L2 adapter 0:fs failed: PermissionError: [Errno 1] Operation not permitted: '/srv/l2/x.bin'"
    ]
    assert errors[0].exc_info is None
    assert any(record.exc_info for record in caplog.records if record.levelno == logging.DEBUG)
