"""Console helpers: one red line for errors, rich output for people, JSON for machines."""

from __future__ import annotations

import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)

#: exit code for bad input or configuration (like a usage error)
EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` as a single line on stderr and exit."""
    one_line = " ".join(str(message).split())
    # The message is text, not markup: "[plot]" in an install hint must survive.
    stderr.print(f"[bold red]error:[/] {escape(one_line)}", markup=True, highlight=False)
    sys.exit(code)
