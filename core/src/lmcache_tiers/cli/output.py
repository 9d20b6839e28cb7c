"""Console helpers: one red line for errors, rich output for people, JSON for machines."""

from __future__ import annotations

import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from lmcache_tiers.config import redact_url_secrets

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)

#: exit code for bad input or configuration (like a usage error)
EXIT_USAGE = 2


#: the longest run of non-blanks an error line quotes whole (a path is at most 4096 bytes)
MAX_WORD = 4096
#: what is kept of each end of a longer one
_WORD_END = 200


def _shorten(word: str) -> str:
    """``word``, or its two ends around a count of what is left out when it is longer than
    MAX_WORD: a refusal quoting a 1 MiB value would otherwise be a 1 MiB line, which
    terminals scroll away and journald splits (the field's path at its end lost)."""
    if len(word) <= MAX_WORD:
        return word
    return f"{word[:_WORD_END]}...({len(word) - 2 * _WORD_END} characters)...{word[-_WORD_END:]}"


def _one_line(message: str) -> str:
    """``message`` on one line, as text (not markup), passwords inside URLs left out, very
    long words shortened: a plugin's refusal may quote the URL it refused, an install hint
    may say "[plot]"."""
    words = redact_url_secrets(" ".join(str(message).split())).split(" ")
    return escape(" ".join(_shorten(word) for word in words))


def warn(message: str) -> None:
    """Print ``warning: message`` as a single line on stderr (the command goes on)."""
    stderr.print(f"[bold yellow]warning:[/] {_one_line(message)}", markup=True, highlight=False)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` as a single line on stderr and exit."""
    stderr.print(f"[bold red]error:[/] {_one_line(message)}", markup=True, highlight=False)
    sys.exit(code)
