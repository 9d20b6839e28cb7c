"""Locks a forked child must not inherit held.

A child forked while another thread of the parent held one of an object's locks (a copy
in progress, the background page-table pass) inherits it held by a thread the child does
not have: the child's first use of it, a client's close there, would wait forever.  Objects
registered here get a fresh set of locks in the child, right after the fork.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class RenewsLocks(Protocol):
    def _after_fork(self) -> None:
        """Replace the locks another thread may have held at the fork (in the child)."""


#: every registered object of this process (weakly: registering keeps nothing alive)
_REGISTERED: weakref.WeakSet[RenewsLocks] = weakref.WeakSet()


def renew_locks_after_fork(owner: RenewsLocks) -> None:
    """Have ``owner._after_fork`` run in every child this process forks from now on."""
    _REGISTERED.add(owner)


def _renew_all() -> None:
    for owner in list(_REGISTERED):
        owner._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_all)
