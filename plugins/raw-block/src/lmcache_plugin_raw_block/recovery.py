"""Rebuilding the slot index of a ``raw_block`` device at start-up.

Start from the newest valid checkpoint, then read slot headers to bring it up to date:

* every checkpointed object's slot: kept when its header still names that key and write;
  a slot rewritten after the checkpoint (the object was deleted or replaced and the slot
  reused) holds a newer write, which is taken instead; anything else is dropped;
* every *watched* slot (claimed, retired or quarantined at the checkpoint): taken when it
  holds a write the checkpoint did not account for;
* the slots free at the checkpoint, lowest first: new writes go to the lowest free slot,
  so the ones written since form a prefix of that list, with gaps only where writes were
  in flight -- at most :data:`CLAIM_GROUP` at a time -- or failed with EIO (the backend
  checkpoints those before there are :data:`UNSAVED_QUARANTINE_MAX`).  The scan stops
  after :data:`SCAN_WINDOW` slots in a row hold nothing newer than the checkpoint.

A header counts only if it is intact (crc), of this device (identity), of this slot and
its record header verifies -- or is intact but of a newer format version: kept as its
key's object, and the backend makes its key a miss until replaced once the table is
restored (see ``slotstore.newer_format``); the payload itself is verified on every load.  Two writes
of one key keep the newer; a record of another serde chain makes its key a miss only if
it is the newer (the scan peeks at records, then marks the keys whose newest write is of
another chain).  Without any valid checkpoint every slot header is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from lmcache_plugin_raw_block.checkpoint import Checkpoint
from lmcache_plugin_raw_block.slotheader import SlotHeader, decode_slot_header
from lmcache_plugin_raw_block.slots import CLAIM_GROUP, SlotEntry
from lmcache_plugin_raw_block.slotstore import newer_format
from lmcache_tiers.plugin import BackendContext, ObjectKey, RecordError

log = logging.getLogger(__name__)

#: free slots in a row without a newer write that end the scan (twice the most that can
#: be in flight at once, plus a margin)
SCAN_WINDOW = 2 * CLAIM_GROUP + 64
#: slots quarantined (a write failed with EIO) since the last checkpoint at which the
#: backend writes a checkpoint before claiming more, pausing stores if it cannot: a run of
#: empty slots is then at most this, one group failing after the check and one group in
#: flight, which is less than the window
UNSAVED_QUARANTINE_MAX = CLAIM_GROUP // 2

ReadHeaders = Callable[[Sequence[int]], list[bytes | None]]


@dataclass
class Recovered:
    entries: list[tuple[ObjectKey, SlotEntry]] = field(default_factory=list)
    next_seq: int = 1
    from_checkpoint: int = 0
    from_headers: int = 0
    dropped: int = 0
    corrupt: int = 0
    #: records of a newer format kept (among the entries), with the error each raised
    newer: list[tuple[ObjectKey, SlotEntry, RecordError]] = field(default_factory=list)
    headers_read: int = 0


class _Recovery:
    def __init__(self, identity: bytes, read_headers: ReadHeaders, context: BackendContext) -> None:
        self.identity = identity
        self.read_headers = read_headers
        self.context = context
        self.result = Recovered()
        #: intact records of another serde chain taken, each its key's object or not
        self.other_chain: list[tuple[ObjectKey, SlotEntry]] = []

    def headers(self, slots: Sequence[int]) -> Iterator[SlotHeader | None]:
        """The decoded header of each of ``slots``, in order, read :data:`SCAN_WINDOW` at
        a time: a checkpoint lists every object of the device, and reading all their
        header blocks at once would hold ``header_bytes`` of memory per object."""
        for start in range(0, len(slots), SCAN_WINDOW):
            chunk = slots[start : start + SCAN_WINDOW]
            self.result.headers_read += len(chunk)
            for slot, raw in zip(chunk, self.read_headers(chunk), strict=True):
                yield None if raw is None else decode_slot_header(raw, self.identity, slot)

    def record_ok(self, header: SlotHeader, entry: SlotEntry) -> bool:
        """Whether the record header in a slot header verifies for its key (a record of
        another serde chain or of a newer format is intact: kept, and a miss here).

        Only peeked: a later write of the key may supersede this one, and a superseded
        record of another chain must not make the key a miss (see
        :meth:`mark_other_chains`)."""
        try:
            if self.context.peek_record_header(header.record, header.key) is None:
                self.other_chain.append((header.key, entry))
        except RecordError as exc:
            if newer_format(exc):
                # Counted and logged by the backend if it is still its key's object once
                # the table is restored (a whole device of them logs a line a minute).
                self.result.newer.append((header.key, entry, exc))
                return True
            self.result.corrupt += 1
            log.warning("raw_block: slot %d (%s) dropped: %s", header.slot, header.key.file_stem(), exc)
            return False
        return True

    def take(self, header: SlotHeader) -> bool:
        entry = SlotEntry(header.slot, header.seq, header.stored, header.l1)
        if not self.record_ok(header, entry):
            return False
        self.result.entries.append((header.key, entry))
        self.result.from_headers += 1
        return True

    def checkpointed(self, checkpoint: Checkpoint, verify: bool) -> None:
        if not verify:
            self.result.entries += checkpoint.entries
            self.result.from_checkpoint += len(checkpoint.entries)
            return
        slots = [entry.slot for _key, entry in checkpoint.entries]
        dropped = 0
        first: tuple[int, ObjectKey] | None = None
        for (key, entry), header in zip(checkpoint.entries, self.headers(slots), strict=True):
            if header is not None and header.seq == entry.seq and header.key == key:
                if self.record_ok(header, entry):
                    self.result.entries.append((key, entry))
                    self.result.from_checkpoint += 1
                continue
            if header is not None and header.seq >= checkpoint.next_seq and self.take(header):
                continue
            dropped += 1
            first = first or (entry.slot, key)
        self.result.dropped += dropped
        if first is not None:
            # One line for them all: a device damaged wholesale would flood the log.
            log.warning(
                "raw_block: %d objects of checkpoint %d dropped: their slot headers no longer "
                "name them (damaged or unreadable, or rewritten by a write in flight at a "
                "crash), e.g. slot %d (%s)",
                dropped,
                checkpoint.seq,
                first[0],
                first[1].file_stem(),
            )

    def mark_other_chains(self, entries: Sequence[tuple[ObjectKey, SlotEntry]]) -> None:
        """Make each key whose object (its newest write among ``entries``) is a record of
        another serde chain a miss until replaced, as core asks, counted and logged there
        (``serde_chain_mismatch``).  Its slot header is read again: holding the record
        of every such write until the scan ends would hold ``header_bytes`` per object.
        One that cannot be read again stays listed; a load of it judges it then."""
        newest: dict[ObjectKey, SlotEntry] = {}
        for key, entry in entries:
            kept = newest.get(key)
            if kept is None or kept.seq < entry.seq:
                newest[key] = entry
        current = [(key, entry) for key, entry in self.other_chain if newest.get(key) == entry]
        headers = self.headers([entry.slot for _key, entry in current])
        for (key, entry), header in zip(current, headers, strict=True):
            if header is not None and header.seq == entry.seq and header.key == key:
                self.context.read_record_header(header.record, key)

    def watched(self, watched: Iterable[tuple[int, int]]) -> None:
        pairs = list(watched)
        for (_slot, lowest), header in zip(pairs, self.headers([s for s, _ in pairs]), strict=True):
            if header is not None and header.seq >= lowest:
                self.take(header)

    def scan(self, free: Iterable[int], newer_than: int, window: int | None) -> None:
        """Take writes newer than ``newer_than`` from ``free`` (ascending) until ``window``
        slots in a row hold none (None: read every slot)."""
        quiet = 0
        batch: list[int] = []
        chunk = SCAN_WINDOW

        def flush() -> bool:
            nonlocal quiet
            for header in self.headers(batch):
                if header is not None and header.seq >= newer_than and self.take(header):
                    quiet = 0
                else:
                    quiet += 1
                if window is not None and quiet >= window:
                    return False
            batch.clear()
            return True

        for slot in free:
            batch.append(slot)
            if len(batch) >= chunk and not flush():
                return
        if batch:
            flush()


def recover(
    slot_count: int,
    identity: bytes,
    checkpoint: Checkpoint | None,
    *,
    verify: bool,
    read_headers: ReadHeaders,
    context: BackendContext,
) -> Recovered:
    """The objects on the device: see the module docstring."""
    recovery = _Recovery(identity, read_headers, context)
    if checkpoint is None:
        recovery.scan(range(slot_count), 0, None)
    else:
        recovery.checkpointed(checkpoint, verify)
        recovery.watched(checkpoint.watched)
        busy = {entry.slot for _key, entry in checkpoint.entries} | {slot for slot, _ in checkpoint.watched}
        free = (slot for slot in range(slot_count) if slot not in busy)
        recovery.scan(free, checkpoint.next_seq, SCAN_WINDOW)
    result = recovery.result
    # A slot is read once, so it yields one object; keep the guard for a checkpoint
    # whose body was written by a faulty build.
    by_slot: dict[int, tuple[ObjectKey, SlotEntry]] = {}
    for key, entry in result.entries:
        kept = by_slot.get(entry.slot)
        if kept is None or kept[1].seq < entry.seq:
            by_slot[entry.slot] = (key, entry)
    result.entries = list(by_slot.values())
    recovery.mark_other_chains(result.entries)
    newest = max((entry.seq for _key, entry in result.entries), default=0)
    result.next_seq = max(newest + 1, checkpoint.next_seq if checkpoint is not None else 1)
    return result
