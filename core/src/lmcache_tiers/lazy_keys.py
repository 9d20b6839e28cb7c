"""A LOOKUP's key list whose keys are decoded only when something asks for them.

A LOOKUP answers the longest cached prefix of its keys, and a prompt nobody stored misses
at its first key: with no L2 adapter, or adapters that all answer lookups at once (asked
about that key alone first), no key past the first is ever looked at.  Decoding and
remembering each of the others (an ``ObjectKey`` built and validated per key) was then
nearly all the cost of looking up a new prompt.  The decoder of such a server
(:mod:`lmcache_tiers.wire.decoding`; with an adapter answering only on its worker, every
key a lookup misses in L1 is asked about) hands out a :class:`LazyKeys` for such a list
instead, once it has proven every key in it valid at once: every piece of the list equals
the first key's canonical encoding except in the bytes of its chunk hash, so each decodes
to the first key with another hash of the same length -- a valid key.

Only the first key is decoded up front.  Anything else -- another index, a slice beyond
it, iteration, membership -- decodes the whole list through the decoder's key cache, as a
list decoded at once would have been, and works on that from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

from lmcache_tiers.keys import ObjectKey

__all__ = ["LazyKeys"]


class LazyKeys(Sequence[ObjectKey]):
    """The keys encoded in ``pieces`` (one key's msgpack each, every one proven valid),
    of which ``first`` is the first, decoded; ``decode_all`` decodes all of them."""

    __slots__ = ("_decode_all", "_decoded", "_distinct", "_first", "_pieces")

    def __init__(
        self,
        pieces: Sequence[bytes],
        first: ObjectKey,
        decode_all: Callable[[Sequence[bytes]], list[ObjectKey]],
        *,
        distinct: bool | None = None,
    ) -> None:
        """``distinct``: whether no key is repeated, when the caller knows already (None:
        worked out when asked)."""
        self._pieces = pieces
        self._first = first
        self._decode_all = decode_all
        self._decoded: list[ObjectKey] | None = None
        self._distinct = distinct  # all_distinct's answer, once asked or told

    def __len__(self) -> int:
        return len(self._pieces)

    @overload
    def __getitem__(self, index: int) -> ObjectKey: ...

    @overload
    def __getitem__(self, index: slice) -> list[ObjectKey]: ...

    def __getitem__(self, index: int | slice) -> ObjectKey | list[ObjectKey]:
        if self._decoded is None:
            if isinstance(index, slice):
                wanted = range(*index.indices(len(self._pieces)))
                if not wanted:
                    return []  # ``keys[:hits]`` of a prompt that missed at once
                if len(wanted) == 1 and wanted[0] == 0:
                    return [self._first]
            elif index == 0 or index == -len(self._pieces):
                return self._first
        return self.decoded()[index]

    def __iter__(self) -> Iterator[ObjectKey]:
        return iter(self.decoded())

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes, bytearray)):
            return NotImplemented
        if len(other) != len(self._pieces):
            return False
        # The first keys first: a list compared with another prompt's (L1 checks the keys
        # of its last full hit this way) differs there, and the rest is never decoded.
        if self._pieces and self._first != other[0]:
            return False
        return self.decoded() == list(other)

    __hash__ = None  # type: ignore[assignment]  # a list's equality: unhashable, as a list

    def __repr__(self) -> str:
        return f"LazyKeys({len(self._pieces)} keys, first {self._first!r})"

    def decoded(self) -> list[ObjectKey]:
        """Every key, in order (decoded now if not yet): the list this keeps, not to be
        changed (the decoder hands one ``LazyKeys`` to every LOOKUP of a list it kept)."""
        if self._decoded is None:
            self._decoded = self._decode_all(self._pieces)
        return self._decoded

    def all_distinct(self) -> bool:
        """Whether no key is repeated, without decoding them: keys of one list of this kind
        are equal exactly when their encodings are (they differ only in their hashes).
        Worked out once: a list the decoder kept is asked again by every LOOKUP of it."""
        if self._distinct is None:
            self._distinct = len(set(self._pieces)) == len(self._pieces)
        return self._distinct
