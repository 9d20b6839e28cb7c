"""Polling the ROUTER for the next request a little while before sleeping on it.

A loop thread that sleeps on its socket between requests is woken for each one, and on a
virtual machine a sleeping thread's CPU is halted and woken through the host: on this
project's 2-core VM that wake-up was most of what a 16-key LOOKUP from one client
cost beyond a bare ZeroMQ round trip (0.69x of its rate).  So after each turn the loop
polls its socket for up to ``REQUEST_SPIN_S`` before it sleeps in its receive, as a
client polls for its reply (``client/spin.py``): each look reads the socket's events,
then gives the CPU to any other thread ready to run there (``sched_yield``, with the GIL
let go) -- libzmq's I/O thread, which brings the request in, is one.

Polling only pays while the thread keeps its CPU.  With a busy process on the same core
a yield hands it the CPU for the rest of its time slice (milliseconds), and a request that
comes meanwhile waits that out, where a sleeping thread would have been woken at once
ahead of the busy one: polling without a check took sequential LOOKUPs from about 6,000
to 900 a second with a busy loop on each core.  A look that comes more than
``SPIN_LOST_S`` after the one before means the CPU went elsewhere: the poll stops there,
and the loop sleeps on its socket for ``SPIN_BACKOFF_S`` before it polls again (twice as
long each time it loses again right after, up to ``MAX_SPIN_BACKOFF_S``), so a busy
machine costs one lost slice per back-off at most.  Nor does a loop that found nothing
for a whole receive timeout poll: an idle server stays asleep.
"""

from __future__ import annotations

import os
import time

import zmq

__all__ = ["MAX_SPIN_BACKOFF_S", "REQUEST_SPIN_S", "SPIN_BACKOFF_S", "SPIN_LOST_S", "RequestSpin"]

#: how long the loop polls for the next request after a turn before it sleeps on the socket
REQUEST_SPIN_S = 0.0005
#: a gap between two looks longer than this: the thread lost its CPU (a look and a yield take
#: microseconds, and libzmq's I/O thread bringing in a request tens of them)
SPIN_LOST_S = 0.0005
#: how long the loop sleeps on its socket, not polling, after a poll lost its CPU
SPIN_BACKOFF_S = 0.25
#: the longest back-off, for a CPU lost again each time the loop polls again
MAX_SPIN_BACKOFF_S = 8.0

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# The backend's getsockopt, as client/spin.py takes it: reading the events costs about a
# microsecond, a receive that finds nothing (zmq.Again) nearly three.
_get = zmq.backend.Socket.get
_now_ns = time.perf_counter_ns
_yield = os.sched_yield


class RequestSpin:
    """The loop thread's poll for its next request (see the module's docstring)."""

    def __init__(self, socket: zmq.Socket[bytes], spin_s: float = REQUEST_SPIN_S) -> None:
        self._socket = socket
        self._spin_ns = int(spin_s * 1e9)
        self._lost_ns = int(SPIN_LOST_S * 1e9)
        self._base_backoff_ns = int(SPIN_BACKOFF_S * 1e9)
        self._max_backoff_ns = int(MAX_SPIN_BACKOFF_S * 1e9)
        self._backoff_ns = self._base_backoff_ns
        #: no poll before this (``perf_counter_ns``): backing off
        self._resume_ns = 0
        #: when the last poll lost its CPU
        self._lost_at_ns = -(1 << 62)
        #: polls that lost their CPU, each followed by a back-off
        self.backoffs = 0

    def poll(self) -> None:
        """Return once a message is ready on the socket, after ``spin_s`` of looking, at
        the first sign that the thread lost its CPU, or at once while backing off."""
        began = _now_ns()
        if began < self._resume_ns or not self._spin_ns:
            return
        sock = self._socket
        until = began + self._spin_ns
        last = began
        while True:
            ready = _get(sock, _EVENTS) & _POLLIN  # type: ignore[operator]  # an int for EVENTS
            now = _now_ns()
            # Checked before a message found: one that came while the CPU was elsewhere
            # waited for it, which is the case to stop polling for.
            if now - last > self._lost_ns:
                self._back_off(now)
                return
            if ready or now >= until:
                return
            last = now
            _yield()

    def _back_off(self, now: int) -> None:
        # Lost again soon after the last back-off ended: the machine stays busy, so the
        # next poll waits longer; after a calm while it starts from the shortest again.
        if now - self._lost_at_ns < 2 * self._backoff_ns + self._base_backoff_ns:
            self._backoff_ns = min(2 * self._backoff_ns, self._max_backoff_ns)
        else:
            self._backoff_ns = self._base_backoff_ns
        self._lost_at_ns = now
        self._resume_ns = now + self._backoff_ns
        self.backoffs += 1
