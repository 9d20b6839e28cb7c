"""The consoles `serve` writes its banner, flush progress, summary and error line on."""

from __future__ import annotations

import contextlib
import errno
import io
import os

from rich.console import Console


class ServeConsole(Console):
    """A console whose reader went away (`serve | head`, a log collector that died) is a
    BrokenPipeError for its caller.  rich's own answer is SystemExit(1): raised out of the
    banner or the summary, it would skip the server's close or replace the stop's exit
    status (0, or 3 for acknowledged writes lost) with 1, and say nothing."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nobody reads it: nothing more is written
        # What is still buffered would fail again at the interpreter's exit ("Exception
        # ignored", exit status 120): the descriptor now leads nowhere instead.
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.file.fileno())
            finally:
                os.close(devnull)
        raise BrokenPipeError(errno.EPIPE, "nobody reads the output any more")
