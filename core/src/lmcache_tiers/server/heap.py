"""The serving process's heap after start-up: collected once, then left out of every
later collection.

Start-up (imports, plugin discovery, configuration, adapters scanning their stores) leaves
hundreds of thousands of long-lived objects behind.  Each full collection of CPython's
cyclic garbage collector walks all of them, which held the GIL for 14-60 ms in the
measurements (docs/internals.md, the paragraph on the serving process's frozen heap),
long enough to be a request's p99 on its own.  Frozen
(``gc.freeze``) they are never walked again, while objects created afterwards are
collected as before.  They are unfrozen before the server closes, so garbage cycles
holding L1 views (which L1's close collects) are found again.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def start_up_heap_frozen() -> Iterator[bool]:
    """Freeze what start-up left on the heap for the duration of the block; yields whether
    it did (only on the main thread: a server started inside another program, such as a
    test, leaves that program's collector alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    gc.collect()  # what is garbage now goes, instead of being frozen for good
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
