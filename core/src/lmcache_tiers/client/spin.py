"""Polling for a reply a little while before sleeping on it.

A client thread that sleeps on its socket while the server works lets its CPU go idle,
and waking it again when the reply comes costs more than the server's work on a virtual
machine, where an idle virtual CPU is halted and woken through the host.  Measured on this
project's 2-core VM with a 16-key LOOKUP answered from L1 (150 calls x 6 rounds per case,
alternating):

* back to back: p50 58 us sleeping on the reply, 40 us polling for it first;
* after 2 ms without a call (an engine between scheduler steps): p50 536 us and p99
  1.15 ms sleeping, 309 us and 0.44 ms polling -- the rest is the server's own CPU waking.

So a call polls its reply for up to ``REPLY_SPIN_S`` (the client's ``reply_spin_s``), then
sleeps on it as before.  Each look reads the socket's events (about 1 us here, with the GIL
held), then, when nothing came, gives the CPU away (``sched_yield``) to another thread ready
to run there -- the server, on a machine with few cores, may be one -- and lets the GIL go
meanwhile, so a busy Python thread of the engine runs beside a poll as fast as beside a
sleeping call; a thread that wakes wanting the GIL may still wait up to the poll's end.  A
reply slower than the poll costs its call up to ``REPLY_SPIN_S`` of CPU more.  0 turns it
off.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import zmq

__all__ = ["REPLY_SPIN_S", "checked_spin", "poll_for_reply"]

#: the default: past the ~0.3 ms a server's idle CPU takes to wake and answer
REPLY_SPIN_S = 0.0005
#: a longer poll is waste: past this, sleeping on the reply costs less than polling for it
MAX_REPLY_SPIN_S = 0.01

_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
# The backend's methods, as connection.py takes them: the sugar wrappers' per-call checks
# cost more than a look that finds nothing.  A look reads the socket's events (1 us here)
# rather than trying a receive, whose zmq.Again costs 2.8 us, most of it with the GIL held.
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_now_ns = time.perf_counter_ns
_yield = os.sched_yield


def checked_spin(seconds: float) -> float:
    """``seconds`` if it is a poll time from 0 (off) to ``MAX_REPLY_SPIN_S``, as a float."""
    if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)) or math.isnan(seconds):
        raise ValueError(f"reply_spin_s must be a number of seconds, got {seconds!r}")
    if not 0 <= seconds <= MAX_REPLY_SPIN_S:
        raise ValueError(f"reply_spin_s must be from 0 to {MAX_REPLY_SPIN_S} seconds, got {seconds!r}")
    return float(seconds)


def poll_for_reply(sock: zmq.Socket[bytes], spin_ns: int) -> Any:
    """The first frame of the next message on ``sock`` (a ``zmq.Frame``), when one comes
    within ``spin_ns`` nanoseconds of polling; else None, and the caller sleeps on it.  A
    zero ``spin_ns`` returns None at once, without a poll."""
    if spin_ns <= 0:
        return None
    until = _now_ns() + spin_ns
    while True:
        if _get(sock, _EVENTS) & _POLLIN:  # type: ignore[operator]  # an int for EVENTS
            try:
                return _recv(sock, _NOBLOCK, False)
            except zmq.Again:  # none after all: looked for again, as after any empty look
                pass
        if _now_ns() >= until:
            return None
        _yield()
