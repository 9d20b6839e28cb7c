"""Waiting for a server that does not answer yet, out loud (``status``, ``bench``,
``replay --url``).

A client's first request waits its whole ``--timeout`` for a server that is not there
(ZeroMQ queues nothing and keeps reconnecting), which looks like a hang.  Yet a server
may well be on its way: it pre-faults its L1 before it listens, which can take many
seconds, and a command started next to it should simply wait.  So the commands first wait
here for the server to answer a HELLO, within the same ``--timeout``: after a couple of
seconds without an answer they say so on stderr, once every ``NOTICE_EVERY_S`` at most,
and when the time is up they fail with one line (``NoAnswerError``, reported like any
failed run: exit code 1).  Once it answered, the command's own clients connect as before,
and nothing more is printed.
"""

from __future__ import annotations

import time

from rich.markup import escape

from lmcache_tiers.cli.output import stderr
from lmcache_tiers.client.errors import RequestTimeoutError

#: how long a server may take to answer before the first notice
NOTICE_AFTER_S = 2.0
#: the shortest time between two notices
NOTICE_EVERY_S = 10.0
#: no notice with less than this left: the error follows at once
_MIN_LEFT_S = 0.5


class NoAnswerError(RequestTimeoutError):
    """The server did not answer a HELLO within the command's ``--timeout``."""


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _notice(text: str) -> None:
    # The URL is text, not markup: tcp://[::1]:5555 must survive.
    stderr.print(f"[yellow]note:[/] {escape(text)}", markup=True, highlight=False)


def wait_for_server(url: str, *, timeout: float, auth_token: str | None) -> None:
    """Return once the server at ``url`` answers a HELLO, at most ``timeout`` seconds from
    now, printing a notice on stderr while it does not; raise NoAnswerError when it never
    did.  That, and any other client error (a refused token, another protocol), is the
    caller's to report like any failure of its run; Ctrl-C raises KeyboardInterrupt as
    anywhere else."""
    from lmcache_tiers.client import Client

    start = time.monotonic()
    deadline = start + timeout
    next_notice = start + NOTICE_AFTER_S
    noticed = False
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            break
        # One attempt lasts until the next notice is due: a server that starts listening
        # meanwhile is answered at once (the client sends as soon as it connects).
        attempt = min(remaining, max(0.05, next_notice - now))
        try:
            with Client(url, timeout=attempt, auth_token=auth_token, shm=False, name="wait"):
                return
        except RequestTimeoutError:
            pass
        if time.monotonic() - now < attempt / 2:  # gave up early: do not spin
            time.sleep(min(0.1, attempt))
        now = time.monotonic()
        remaining = deadline - now
        if now >= next_notice and remaining > _MIN_LEFT_S:
            what = (
                f"still no answer from {url}"
                if noticed
                else f"no answer from {url} yet (not started, or still starting?)"
            )
            _notice(f"{what}; trying for {_seconds(remaining)} more (--timeout {timeout:g})")
            noticed = True
            next_notice = now + NOTICE_EVERY_S
    raise NoAnswerError(
        # The commands speak the native protocol: an lmcache_mp front end at the address
        # (the doc's LMCache-only example uses the default URL's port) never answers them.
        f"no answer within --timeout {timeout:g} s: is the server running, with a native front end "
        "listening there? (an lmcache_mp front end does not answer this command)"
    )
