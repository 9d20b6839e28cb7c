"""The serde chain as an adapter applies it: encoding into staged buffers, decoding into L1.

With an identity chain nothing happens: backends get slices of L1 and write into them.
Otherwise every encoded object is staged in a page-aligned buffer owned by the adapter
(so a backend using ``O_DIRECT`` can write it as it is) and every load reads into one:

* the staging buffer of an encoded object is sized from the chain's bound when every
  serde declares ``max_encoded_size``, and from the output otherwise; an output larger
  than its serde's bound fails that object (``SerdeBoundError``), and nothing is ever
  copied past a buffer;
* a serde raising fails that object only, never its batch;
* decoded bytes reach the L1 buffer only when they are exactly its size.

Staging buffers come from a small pool (power-of-two size classes, a bounded amount kept
for reuse): fresh memory is slow to touch the first time, reused memory is not.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.buffers import copy_into
from lmcache_tiers.protocols import Serde
from lmcache_tiers.serde import IdentitySerde, SerdeContext, decode_chain, serde_names, stage_contexts

__all__ = ["SerdeBoundError", "SerdeChain", "Staged", "StagingPool"]

#: smallest staging buffer (one page)
_MIN_CLASS = mmap.PAGESIZE
#: staging memory kept for reuse per adapter; more is unmapped when released
DEFAULT_RETAIN_BYTES = 256 << 20


class SerdeBoundError(ValueError):
    """A serde returned more bytes than the bound it declares."""


class Staged:
    """One staging buffer lent out by a :class:`StagingPool`; ``view`` is its used part."""

    __slots__ = ("_block", "_pool", "_whole", "view")

    def __init__(self, pool: StagingPool, block: mmap.mmap, size: int) -> None:
        self._pool = pool
        self._block = block
        self._whole = memoryview(block)
        self.view = self._whole[:size]

    @property
    def capacity(self) -> int:
        return len(self._block)

    def resize(self, size: int) -> memoryview:
        """Use the first ``size`` bytes (at most the capacity) as the view."""
        if size > len(self._block):
            raise SerdeBoundError(f"{size} bytes do not fit a staging buffer of {len(self._block)}")
        self.view.release()
        self.view = self._whole[:size]
        return self.view

    def release(self, *, reuse: bool = True) -> None:
        """Give the buffer back; ``reuse=False`` when a backend call may still touch it.

        Never raises: a late reader or writer holding the view itself (a call abandoned on
        close, still blocked in ``readv`` on it in another thread) makes releasing it fail;
        the view then stays, keeping the memory mapped for that user, and the buffer is
        not lent out again.  Raising here would skip the caller's unpinning.
        """
        try:
            self.view.release()
            self._whole.release()
        except BufferError:
            reuse = False
        self._pool.give_back(self._block, reuse=reuse)


class StagingPool:
    """Page-aligned buffers in power-of-two size classes, reused up to ``retain_bytes``."""

    def __init__(self, retain_bytes: int = DEFAULT_RETAIN_BYTES) -> None:
        self._retain = retain_bytes
        self._kept = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def size_class(size: int) -> int:
        return max(_MIN_CLASS, 1 << max(0, size - 1).bit_length())

    def take(self, size: int) -> Staged:
        """A buffer of at least ``size`` bytes whose view is the first ``size``."""
        wanted = self.size_class(size)
        with self._lock:
            blocks = self._free.get(wanted)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._kept -= wanted
        if block is None:
            block = mmap.mmap(-1, wanted)  # anonymous: page-aligned
        return Staged(self, block, size)

    def give_back(self, block: mmap.mmap, *, reuse: bool) -> None:
        if not reuse or not _unexported(block):
            # A late writer, or someone (a serde, a backend) still holding a view: never
            # lent out again; the mapping goes when the last view does.
            return
        size = len(block)
        with self._lock:
            if self._kept + size <= self._retain:
                self._free.setdefault(size, []).append(block)
                self._kept += size
                return
        block.close()

    def clear(self) -> None:
        with self._lock:
            blocks = [block for free in self._free.values() for block in free]
            self._free.clear()
            self._kept = 0
        for block in blocks:
            block.close()


def _unexported(block: mmap.mmap) -> bool:
    """Whether no view of ``block`` is alive (resizing refuses while one is)."""
    try:
        block.resize(len(block))
    except (BufferError, OSError, SystemError):
        return False
    return True


def _bound_of(serde: Serde) -> Callable[[int], int] | None:
    bound = getattr(serde, "max_encoded_size", None)
    return bound if callable(bound) else None


class SerdeChain:
    """An adapter's serde chain in encoding order; wrappers append their inner chain."""

    def __init__(self, serdes: Sequence[Serde] = ()) -> None:
        self._serdes: tuple[Serde, ...] = ()
        self.pool = StagingPool()
        self.extend(serdes)

    def extend(self, serdes: Sequence[Serde]) -> None:
        """Append stages that encode after (and decode before) the current ones."""
        self._serdes = (*self._serdes, *(s for s in serdes if not isinstance(s, IdentitySerde)))
        self.names = serde_names(self._serdes)
        self.identity = not self._serdes
        bounds = [_bound_of(serde) for serde in self._serdes]
        self._bounds = bounds if all(bound is not None for bound in bounds) else None

    @property
    def serdes(self) -> tuple[Serde, ...]:
        return self._serdes

    def bound(self, size: int) -> int | None:
        """Upper bound of the encoded size of ``size`` bytes; None if some serde has none."""
        if self._bounds is None:
            return None
        for bound in self._bounds:
            assert bound is not None
            size = int(bound(size))
        return size

    def encode(self, key: ObjectKey, data: memoryview, layout: str = "") -> Staged:
        """The encoded object in a staging buffer (release it after the backend call).

        Raises whatever a serde raises, or :class:`SerdeBoundError`.
        """
        # The layout describes the object's bytes, which only the first stage receives:
        # later stages get the previous stage's output, which no layout describes (they
        # still learn what the record will state, see ``SerdeContext.record_layout``).
        context = SerdeContext(key, data.nbytes, layout, layout)
        bound = self.bound(data.nbytes)
        staged = self.pool.take(bound) if bound is not None else None
        try:
            for serde, stage_context in stage_contexts(self._serdes, context):
                stage_bound = _bound_of(serde)
                limit = int(stage_bound(data.nbytes)) if stage_bound is not None else None
                data = memoryview(serde.encode(data, stage_context)).cast("B")
                if limit is not None and data.nbytes > limit:
                    raise SerdeBoundError(
                        f"serde {serde.name!r} returned {data.nbytes} bytes, its bound is {limit}"
                    )
            if staged is None:
                staged = self.pool.take(data.nbytes)
            copy_into(staged.resize(data.nbytes), data)
        except BaseException:
            if staged is not None:
                staged.release()
            raise
        return staged

    def decode_into(
        self, key: ObjectKey, encoded: memoryview, target: memoryview, record_layout: str = ""
    ) -> None:
        """Decode ``encoded`` into ``target`` (the object's L1 buffer), or raise;
        ``record_layout`` is the layout its record stated ("" if none was read)."""
        context = SerdeContext(key, target.nbytes, record_layout=record_layout)
        decoded = decode_chain(self._serdes, encoded, context)
        if decoded.nbytes != target.nbytes:
            raise ValueError(f"decoded {decoded.nbytes} bytes, the L1 object holds {target.nbytes}")
        copy_into(target, decoded)
