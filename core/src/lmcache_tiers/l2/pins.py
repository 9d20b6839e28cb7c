"""Pin counts between lookup and load, the keys a store is writing, and the keys a delete
is working on."""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Sequence

from lmcache_tiers.keys import ObjectKey


class Claim(enum.Enum):
    """What :meth:`PinTable.claim_delete` answered for one key."""

    CLAIMED = "claimed"  # the delete may remove it now
    DELETING = "deleting"  # another delete (or a repeat within the batch) is working on it
    PINNED = "pinned"  # a lookup promised it to a load, or a load is copying it
    STORING = "storing"  # a store of it is in the backend call


class PinTable:
    """Which keys are pinned (counted), being written by a store (counted) and being
    deleted right now.

    Every check below is decided under one lock, together with the claim it leads to:

    * a key being deleted cannot be pinned (a lookup racing with the delete reports a
      miss) and a pinned key cannot start being deleted, so the backend never removes
      bytes a lookup has promised to a load;
    * a key being written by a store cannot start being deleted, and a store does not
      start writing a key being deleted: a store and a delete of one key never overlap,
      so their backend calls cannot land in either order, and core's accounting and
      listeners always agree with the backend (the store's accounting and its
      ``on_l2_keys_stored`` come before any later delete's, a delete's
      ``on_l2_keys_deleted`` before any later store's).  Stores of one key may overlap
      each other (counted, as pins are).

    The absence check after a delete (``begin_check``) claims keys as a delete does
    against pins and other deletes, but not against stores: it only releases an entry
    that no store replaced meanwhile (``ByteAccounting.forget_if``), so a store racing
    it is safe either way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: Counter[ObjectKey] = Counter()
        self._writers: Counter[ObjectKey] = Counter()
        #: keys claimed by a delete or an absence check
        self._deleting: set[ObjectKey] = set()
        #: those of them claimed by a delete: no store may start writing them
        self._removing: set[ObjectKey] = set()

    @staticmethod
    def _drop(counts: Counter[ObjectKey], keys: Sequence[ObjectKey]) -> int:
        """One count off per occurrence (call with the lock held); returns how many were held."""
        dropped = 0
        for key in keys:
            count = counts.get(key, 0)
            if count <= 0:
                continue
            dropped += 1
            if count == 1:
                del counts[key]
            else:
                counts[key] = count - 1
        return dropped

    # -- pins (lookups and loads) ---------------------------------------------------------------

    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Pin each key once unless it is being deleted; True where pinned."""
        pinned: list[bool] = []
        with self._lock:
            for key in keys:
                if key in self._deleting:
                    pinned.append(False)
                else:
                    self._pins[key] += 1
                    pinned.append(True)
        return pinned

    def unpin(self, keys: Sequence[ObjectKey]) -> int:
        """Drop one pin per occurrence; returns how many pins were actually held."""
        with self._lock:
            return self._drop(self._pins, keys)

    # -- writers (stores in the backend call) ---------------------------------------------------

    def begin_write(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Claim each key for one store unless a delete is working on it; True where
        claimed.  Counted per occurrence: every True needs one :meth:`end_write` of it.
        """
        claimed: list[bool] = []
        with self._lock:
            for key in keys:
                if key in self._removing:
                    claimed.append(False)
                else:
                    self._writers[key] += 1
                    claimed.append(True)
        return claimed

    def end_write(self, keys: Sequence[ObjectKey]) -> int:
        """Drop one write claim per occurrence; returns how many were actually held."""
        with self._lock:
            return self._drop(self._writers, keys)

    # -- deletes --------------------------------------------------------------------------------

    def claim_delete(self, keys: Sequence[ObjectKey], *, check: bool = False) -> list[Claim]:
        """Claim keys for deletion: :attr:`Claim.CLAIMED`, or why a key was not claimed
        (being deleted or checked already, or repeated within the batch; pinned; being
        stored).  ``check``: for the absence check after a delete, which stores neither
        refuse nor are refused by."""
        claims: list[Claim] = []
        with self._lock:
            for key in keys:
                if key in self._deleting:
                    claims.append(Claim.DELETING)
                elif self._pins.get(key, 0) > 0:
                    claims.append(Claim.PINNED)
                elif not check and self._writers.get(key, 0) > 0:
                    claims.append(Claim.STORING)
                else:
                    self._deleting.add(key)
                    if not check:
                        self._removing.add(key)
                    claims.append(Claim.CLAIMED)
        return claims

    def begin_delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Claim keys for deletion; False for pinned keys, keys being stored and repeats
        within the batch."""
        return [claim is Claim.CLAIMED for claim in self.claim_delete(keys)]

    def begin_check(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Claim keys for the absence check after a delete; False for pinned keys and
        keys being deleted or checked (stores of them may run meanwhile)."""
        return [claim is Claim.CLAIMED for claim in self.claim_delete(keys, check=True)]

    def end_delete(self, keys: Sequence[ObjectKey]) -> None:
        """Drop the claims of a delete or of an absence check."""
        with self._lock:
            self._deleting.difference_update(keys)
            self._removing.difference_update(keys)

    # -- reading ------------------------------------------------------------------------------

    def count(self, key: ObjectKey) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def pinned(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            return [self._pins.get(key, 0) > 0 for key in keys]

    def busy(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether a delete would refuse each key now for core's own reasons: pinned, or
        a store of it in flight (not counting keys another delete is working on)."""
        with self._lock:
            return [self._pins.get(key, 0) > 0 or self._writers.get(key, 0) > 0 for key in keys]

    def snapshot(self) -> dict[ObjectKey, int]:
        with self._lock:
            return dict(self._pins)

    def writers(self) -> dict[ObjectKey, int]:
        """Write claims held now, per key (diagnostics; tests that claims return to zero)."""
        with self._lock:
            return dict(self._writers)

    def deleting(self) -> set[ObjectKey]:
        """Keys a delete is working on now (diagnostics)."""
        with self._lock:
            return set(self._deleting)

    def clear(self) -> None:
        with self._lock:
            self._pins.clear()
