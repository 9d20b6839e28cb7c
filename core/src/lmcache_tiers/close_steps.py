"""A failed step of a close, logged once and named: shared by the server's stop and the
storage's close, whose steps all run whatever an earlier one raised."""

from __future__ import annotations

import logging
import traceback

__all__ = ["logged_close_failure"]


def logged_close_failure(log: logging.Logger, what: str, exc: Exception, going_on: str) -> str:
    """Log ``what`` failing with its traceback, then ``going_on``; return ``what failed:
    Type: message`` for the line that names every failed step.

    The traceback is logged as text, not as the exception: a handler that keeps records
    would keep the exception's frames, which may hold views into L1."""
    log.error("%s failed; %s:\n%s", what, going_on, "".join(traceback.format_exception(exc)).rstrip())
    return f"{what} failed: {type(exc).__name__}: {exc}"
