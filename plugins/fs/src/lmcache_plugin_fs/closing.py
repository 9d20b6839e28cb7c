"""What the local and the remote record stores say about a store cut short by the close."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def explain_unwritten(name: str, closing: bool, results: list[bool]) -> None:
    """One line for a store whose records were not all written because the adapter is
    closing (core counts them ``store_keys_failed``; this says why)."""
    if closing and not all(results):
        log.info(
            "%s: %d of %d records of a store not written: the adapter is closing",
            name,
            results.count(False),
            len(results),
        )
