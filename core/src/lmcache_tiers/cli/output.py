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


def _one_line(message: str) -> str:
    """``message`` on one line, as text (not markup), passwords inside URLs left out: a
    plugin's refusal may quote the URL it refused, an install hint may say "[plot]"."""
    return escape(redact_url_secrets(" ".join(str(message).split())))


def warn(message: str) -> None:
    """Print ``warning: message`` as a single line on stderr (the command goes on)."""
    stderr.print(f"[bold yellow]warning:[/] {_one_line(message)}", markup=True, highlight=False)


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` as a single line on stderr and exit."""
    stderr.print(f"[bold red]error:[/] {_one_line(message)}", markup=True, highlight=False)
    sys.exit(code)
