"""Stop signals from the first instant of a command: one line and exit 128 + the signal.

The command's own handling (serve's stop, the replay's unwinding) is in place only once
its modules loaded, the plugins were discovered and its options parsed, a second or more
on a loaded machine.  Before that SIGTERM, SIGHUP and SIGQUIT ended the process silently
(exit -15, -1, -3) and a Ctrl-C while the entry point imported printed a KeyboardInterrupt
traceback.  This module
imports nothing but the standard library, so that the entry point installs it before
anything heavy.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

#: the attribute that marks an exception a signal raised (``signalled``)
SIGNAL_MARK = "replay_signal"

#: set once start-up is over (``command_running``): a stop signal from then on stopped the
#: command, it did not come as the command started
_running = threading.Event()

#: the stop signals whose default action ends the process with no word: they raise instead
#: (SIGINT raises KeyboardInterrupt by itself).  The signals serve stops on, all of them.
RAISING = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def unwinding(signum: int) -> BaseException:
    """What a stop signal raises where the command is: KeyboardInterrupt for SIGINT,
    SystemExit(128 + signum) otherwise, marked as a signal's so that it is told apart from
    the SystemExit of an error already reported."""
    exc: BaseException = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
    setattr(exc, SIGNAL_MARK, signum)
    return exc


def signalled(exc: BaseException) -> int | None:
    """The signal that raised ``exc`` (SIGINT for any KeyboardInterrupt, which only Ctrl-C
    raises), or None: a SystemExit of ``sys.exit``, whose error line is printed already."""
    if isinstance(exc, KeyboardInterrupt):
        return int(getattr(exc, SIGNAL_MARK, signal.SIGINT))
    mark = getattr(exc, SIGNAL_MARK, None)
    return mark if isinstance(mark, int) else None


def _raise_stop(signum: int, _frame: Any) -> None:
    # A second signal takes its default action (the process ends at once), never SIG_IGN:
    # code the first one unwinds through may swallow it (a plugin's `except BaseException`),
    # and the command would then run on deaf to SIGTERM and Ctrl-C.
    for each in (*RAISING, signal.SIGINT):
        if signal.getsignal(each) in (_raise_stop, signal.default_int_handler):
            signal.signal(each, signal.SIG_DFL)
    raise unwinding(signum)


def handed_over() -> None:
    """The command puts its own stop handling in place now (serve): SIGTERM, SIGHUP and
    SIGQUIT go back to their default action, which that handling records and puts back when it is done.  Left
    raising, a SIGTERM after the server stopped (the process lingering for threads stuck
    in calls) unwound past the exit that leaves those threads behind, with a line saying
    it came as the command started."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in RAISING:
        if signal.getsignal(sig) is _raise_stop:
            signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def command_running() -> Iterator[None]:
    """Start-up is over: the command line is parsed and the command's own code runs.  A
    stop signal from here on is reported as stopping the command (a client waiting for
    its server, a plugin's command at work), not as having come while it started.

    Held around the command's run (a resource of the root context): a KeyboardInterrupt
    the command left unhandled leaves it as SIGINT's SystemExit, which typer lets through
    to :func:`ended_at_start`; as a KeyboardInterrupt, typer turned it into a silent exit
    130 and Ctrl-C said nothing where SIGTERM says "stopped by SIGTERM"."""
    _running.set()
    try:
        yield
    except KeyboardInterrupt as exc:
        stop = SystemExit(128 + signal.SIGINT)
        setattr(stop, SIGNAL_MARK, signal.SIGINT)
        raise stop from exc


@contextlib.contextmanager
def ended_at_start() -> Iterator[None]:
    """Run the command with SIGTERM, SIGHUP and SIGQUIT raising (SIGINT raises
    KeyboardInterrupt already); a
    stop signal nothing else reported is one line on stderr and exit 128 + the signal:
    "as the command started" before :func:`command_running`, "stopped by" after it.

    A signal the process inherited ignored stays ignored (a server started in a script's
    background keeps SIGINT ignored, and serve tells that case by it).  The handlers from
    before are put back on the way out (tests run the entry point in their own process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _running.clear()  # (tests run the entry point many times in one process)
    previous = {sig: signal.getsignal(sig) for sig in (*RAISING, signal.SIGINT)}
    for sig in RAISING:
        if previous[sig] == signal.SIG_DFL:
            signal.signal(sig, _raise_stop)
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        signum = signalled(exc)
        if signum is None:
            raise  # sys.exit() of an error already reported
        name = signal.Signals(signum).name
        # Written as it is: the console module may be what was importing.
        if _running.is_set():
            sys.stderr.write(f"error: stopped by {name}\n")
        else:
            sys.stderr.write(f"error: interrupted ({name}) as the command started\n")
        sys.stderr.flush()
        raise SystemExit(128 + signum) from None
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
