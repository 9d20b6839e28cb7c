"""A stand-in key that counts how often anything hashes it, for tests holding a data
structure to the number of per-key dict or set operations it costs (the hot paths of
lookups and eviction policies are meant to touch each key a bounded number of times)."""

from __future__ import annotations


class HashCountingKey:
    """A key that counts how often anything hashes it (in ``HashCountingKey.hashes``, which
    a test sets to 0 before the operation it measures)."""

    hashes = 0

    def __init__(self, index: int) -> None:
        self.index = index

    def __hash__(self) -> int:
        HashCountingKey.hashes += 1
        return self.index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashCountingKey) and other.index == self.index

    def __repr__(self) -> str:
        return f"key{self.index}"
