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


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` as a single line on stderr and exit.  Passwords inside
    URLs are left out: a plugin's refusal may quote the URL it refused."""
    one_line = redact_url_secrets(" ".join(str(message).split()))
    # The message is text, not markup: "[plot]" in an install hint must survive.
    stderr.print(f"[bold red]error:[/] {escape(one_line)}", markup=True, highlight=False)
    sys.exit(code)
