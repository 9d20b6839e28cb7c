"""The order in which a benchmark's methods take their turns, round by round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(methods: Sequence[T], round_index: int) -> list[T]:
    """``methods`` as given in even rounds, reversed in odd ones.  A method runs on what
    the one before it left behind (page cache, dirty pages, warm connections, the CPU's
    clock, garbage to collect): reversed, each method follows another in one round and
    precedes it in the next, and every pair of methods compared runs in both orders.  (A
    rotation would not do: it keeps each method's predecessor, but in the round it opens.)"""
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))
