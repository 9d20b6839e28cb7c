"""``ControllerThread.wait_idle`` (what ``StorageManager.flush`` waits on) never answers idle
while a step is still giving back what finished work held.

The store controller reaps a finished task (its record leaves ``busy``) before it drops the
task's L1 store locks; a flush that looked at ``busy`` in between returned with those locks
still held, and the engine property test then counted read locks nobody held.
"""

from __future__ import annotations

import threading

from lmcache_tiers.controllers.base import ControllerThread


class ReleasesAfterReaping(ControllerThread):
    """Holds a lock for outstanding work; once told to, a step forgets the work first
    (``busy`` turns false, as a reaped task's record leaves the tracker) and releases the
    lock only when ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__("wait-idle-probe", interval_s=3600.0)
        self.outstanding = True
        self.lock_held = True
        self.reap_next = False
        self.asked = threading.Event()  # a waiter whose wake-up was served asked ``busy``
        self.releasing = threading.Event()  # the work is forgotten, its lock still held
        self.gate = threading.Event()

    def busy(self) -> bool:
        # Only waiters ask (the loop asks only once stopping): a waiter asks once the
        # step serving its wake-up has ended, so from then on only ``busy`` stands
        # between it and "idle".
        self.asked.set()
        return self.outstanding

    def step(self, ready_fds: set[int]) -> None:
        if not self.reap_next:
            return
        self.reap_next = False
        self.outstanding = False
        self.releasing.set()
        self.gate.wait()
        self.lock_held = False


def test_wait_idle_does_not_answer_idle_while_a_step_still_holds_locks() -> None:
    controller = ReleasesAfterReaping()
    controller.start()
    try:
        answers: list[tuple[bool, bool]] = []

        def flush() -> None:
            # It times out while the reaping step is held at the gate: the answer it gives
            # then must not be "idle" with the lock still held.
            idle = controller.wait_idle(timeout=2.0)
            answers.append((idle, controller.lock_held))

        waiter = threading.Thread(target=flush)
        waiter.start()
        assert controller.asked.wait(10)
        controller.reap_next = True
        controller.wake()
        assert controller.releasing.wait(10)
        waiter.join(30)
        assert not waiter.is_alive()
        assert answers, "the waiter did not answer"
        idle, lock_held = answers[0]
        assert not (idle and lock_held), "wait_idle answered idle while the step still held the lock"
        controller.gate.set()
        assert controller.wait_idle(timeout=30)
        assert not controller.lock_held
    finally:
        controller.gate.set()
        controller.stop(5.0)
