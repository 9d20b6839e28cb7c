"""An L1 object's bytes lent to code that moves them: controllers, inline copies.

The memory L1 lends the object's own extent.  The NVMe L1 has no memory to lend, so it
stages the bytes in a page-aligned host buffer: read from the file when the loan is for
reading, written to the file by :meth:`L1Loan.commit` when it is for filling.  Borrowers
handle every backing the same way, and only ``l1/`` knows which one is in use.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["L1Loan"]


class L1Loan:
    """``buffer`` holds the object's bytes for as long as the borrower keeps its lock on
    the object (a read lock, or the write lock of an object being filled)."""

    __slots__ = ("_commit", "_staged", "_verify", "buffer")

    def __init__(
        self,
        buffer: memoryview,
        *,
        staged: bool,
        commit: Callable[[], None] | None = None,
        verify: Callable[[], None] | None = None,
    ) -> None:
        self.buffer = buffer
        self._staged = staged
        self._commit = commit
        # raises KeyError when a lent extent may have changed hands during a copy of it
        self._verify = verify

    def commit(self) -> None:
        """Make what was written into ``buffer`` the object's bytes (a lent extent already
        is them).  Raises KeyError if the object has left L1, ValueError if it is no
        longer being written, OSError if the NVMe write fails."""
        if self._commit is not None:
            self._commit()

    def detach(self) -> memoryview | bytearray:
        """The bytes in a buffer the caller may keep after its lock is gone: the staged
        copy itself, or a copy of the lent extent (numpy copies with the GIL released).
        Raises KeyError if the object left L1 and its extent may have been reused before
        the copy ended."""
        if self._staged:
            return self.buffer
        out = bytearray(self.buffer.nbytes)
        np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(self.buffer, dtype=np.uint8))
        if self._verify is not None:
            self._verify()
        return out
