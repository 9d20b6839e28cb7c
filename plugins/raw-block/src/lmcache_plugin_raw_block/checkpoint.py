"""The two checkpoint areas of a ``raw_block`` device, written in turn.

An area is a header block, then a msgpack body: the write sequence number the next
store gets, every published object (slot, sequence number, sizes, key) and the
*watched* slots (claimed, retired or quarantined when the snapshot was taken), and
whether it was written at shutdown (*clean*: nothing changed after it).  Header:
magic "LMTRCKP1" | version u32 | device identity 16B | checkpoint seq u64 | body_len u64
| body crc32 u32 | header crc32 u32.

A checkpoint goes to the area not holding the newest one -- body first, then header, then
``fsync`` -- so a crash at any point leaves the previous checkpoint intact in the other
area; recovery takes the valid one with the highest sequence number.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass
from typing import Final

import msgspec

from lmcache_plugin_raw_block.aligned import round_up
from lmcache_plugin_raw_block.device import BlockDevice
from lmcache_plugin_raw_block.geometry import Geometry
from lmcache_plugin_raw_block.slots import SlotEntry, Snapshot
from lmcache_tiers.plugin import KeyValidationError, ObjectKey

log = logging.getLogger(__name__)

CHECKPOINT_MAGIC: Final = b"LMTRCKP1"
CHECKPOINT_VERSION: Final = 1
_HEADER = struct.Struct("<8sI16sQQI")
_CRC = struct.Struct("<I")


class _Body(msgspec.Struct, array_like=True, frozen=True):
    next_seq: int
    # (slot, seq, stored, l1, key)
    entries: list[tuple[int, int, int, int, ObjectKey]]
    # (slot, lowest sequence number of a write not accounted for)
    watched: list[tuple[int, int]]
    # written by a closing adapter: nothing changed on the device after it.  Last, with a
    # default, so bodies written before it existed still decode (as not clean).
    clean: bool = False


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Body)


@dataclass(frozen=True)
class Checkpoint:
    seq: int
    next_seq: int
    entries: list[tuple[ObjectKey, SlotEntry]]
    watched: list[tuple[int, int]]
    #: written at shutdown: its entries are what the slots hold, without reading them
    clean: bool = False


class CheckpointTooLarge(Exception):
    """The snapshot does not fit a checkpoint area."""


class CheckpointAreas:
    """Reads and writes the checkpoints of one device (one writer at a time)."""

    def __init__(self, device: BlockDevice, geometry: Geometry, identity: bytes) -> None:
        self._device = device
        self._geometry = geometry
        self._identity = identity
        self.seq = 0  # the highest on the device: of the newest written, or any header read
        self._area = 1  # holding the newest, so the next write goes to the other
        #: checkpoints ``read_newest`` passed over: unreadable, damaged or undecodable
        self.unusable = 0
        #: ``read_newest`` passed over a checkpoint that may be newer than the one it
        #: returned (or than none): one that may read again later, until one supersedes it
        self.newer_passed_over = False
        #: areas whose header could not be read: of any number, until overwritten
        self._unread: set[int] = set()
        #: the highest sequence number of a checkpoint of another format version read
        self._other_version_seq = 0
        #: areas whose header ``read_newest`` found damaged (neither blank nor intact)
        self._damaged: list[int] = []

    def _header(self, seq: int, body: bytes) -> bytes:
        fields = _HEADER.pack(
            CHECKPOINT_MAGIC, CHECKPOINT_VERSION, self._identity, seq, len(body), zlib.crc32(body)
        )
        return fields + _CRC.pack(zlib.crc32(fields))

    def _readable_header(self, area: int) -> tuple[int, int, int] | None:
        try:
            return self._read_header(area)
        except OSError as exc:
            log.warning("raw_block: the checkpoint header of area %d cannot be read (%s)", area, exc)
            self.unusable += 1
            return None

    def _read_header(self, area: int) -> tuple[int, int, int] | None:
        """(seq, body_len, body_crc) of an intact header of this device, else None."""
        data = self._device.read_at(self._geometry.area_offset(area), self._geometry.block_align)
        if len(data) < _HEADER.size + _CRC.size:
            return None
        magic, version, identity, seq, length, body_crc = _HEADER.unpack_from(data)
        (crc,) = _CRC.unpack_from(data, _HEADER.size)
        if magic != CHECKPOINT_MAGIC or zlib.crc32(data[: _HEADER.size]) != crc:
            # Formatting blanks both headers: anything else but a checkpoint is damage.
            if data.strip(b"\0"):
                self._damaged_header(area, "its magic or crc does not match")
            return None
        if identity != self._identity:
            self._damaged_header(area, "it names another device identity")
            return None
        if version != CHECKPOINT_VERSION:
            self._other_version(area, seq, version)
            return None
        if length > self._geometry.area_bytes - self._geometry.block_align:
            self._damaged_header(area, f"its body length {length} exceeds the area")
            return None
        return seq, length, body_crc

    def _damaged_header(self, area: int, why: str) -> None:
        """A header neither blank nor intact: the checkpoint it held -- perhaps the newest
        -- is lost, so the one recovery takes may be older (counted, logged).  It never
        reads as valid again, so it need not be superseded first."""
        log.warning("raw_block: the checkpoint header of area %d is damaged (%s); passed over", area, why)
        self.unusable += 1
        self._damaged.append(area)

    def _other_version(self, area: int, seq: int, version: int) -> None:
        """An intact checkpoint of another format version (a newer server's, before a
        downgrade): passed over, counted, and outranked by every checkpoint written from
        now on, so that server never takes it for newer than this one's after an upgrade."""
        log.warning(
            "raw_block: checkpoint %d in area %d has format version %d, this server reads %d; passed over",
            seq,
            area,
            version,
            CHECKPOINT_VERSION,
        )
        self.unusable += 1
        self._other_version_seq = max(self._other_version_seq, seq)

    def read_newest(self) -> Checkpoint | None:
        """The valid checkpoint with the highest sequence number, or None.

        An area that cannot be read (a media error) is one more damaged area: the other
        one, or a read of every slot header, recovers the device, where raising would
        keep the adapter from opening at all."""
        headers: list[tuple[int, tuple[int, int, int]]] = []
        unread: list[int] = []
        self._damaged = []
        for area in (0, 1):
            before = self.unusable
            found = self._readable_header(area)
            if found is not None:
                headers.append((area, found))
            elif self.unusable > before and area not in self._damaged:
                unread.append(area)
        # A checkpoint passed over now (its body unreadable for the moment) may read again
        # after a crash: every later checkpoint must outrank it, or a restart would take it
        # for the newest.  An area whose header could not be read is overwritten first.
        self.seq = max([found[0] for _area, found in headers] + [self._other_version_seq])
        self._area = 1 - unread[0] if unread else 1
        self._unread = set(unread)
        damaged = bool(self._damaged)  # it may have held a newer checkpoint than any read
        self.newer_passed_over = bool(unread) or bool(headers) or damaged
        for area, (seq, length, body_crc) in sorted(headers, key=lambda item: -item[1][0]):
            start = self._geometry.area_offset(area) + self._geometry.block_align
            try:
                body = self._device.read_at(start, round_up(length, self._geometry.block_align))[:length]
            except OSError as exc:
                log.warning(
                    "raw_block: checkpoint %d in area %d cannot be read (%s); trying the other",
                    seq,
                    area,
                    exc,
                )
                self.unusable += 1
                continue
            if len(body) != length or zlib.crc32(body) != body_crc:
                log.warning("raw_block: checkpoint %d in area %d is damaged; trying the other", seq, area)
                self.unusable += 1
                continue
            try:
                decoded = _DECODER.decode(body)
            except (msgspec.DecodeError, KeyValidationError) as exc:
                log.warning("raw_block: checkpoint %d cannot be decoded (%s); trying the other", seq, exc)
                self.unusable += 1
                continue
            self._area = area
            self.newer_passed_over = bool(unread) or damaged or seq < self.seq
            entries = [
                (key, SlotEntry(slot, write_seq, stored, l1))
                for slot, write_seq, stored, l1, key in decoded.entries
            ]
            return Checkpoint(seq, decoded.next_seq, entries, decoded.watched, decoded.clean)
        return None

    def write(self, snapshot: Snapshot, *, clean: bool = False) -> int:
        """Write ``snapshot`` as the next checkpoint (``clean``: the adapter is closing);
        returns its body size."""
        body = _ENCODER.encode(
            _Body(
                snapshot.next_seq,
                [(e.slot, e.seq, e.stored, e.l1, key) for key, e in snapshot.entries],
                snapshot.watched,
                clean,
            )
        )
        room = self._geometry.area_bytes - self._geometry.block_align
        if len(body) > room:
            raise CheckpointTooLarge(f"a checkpoint of {len(body)} bytes does not fit its area of {room}")
        area, seq = 1 - self._area, self.seq + 1
        start = self._geometry.area_offset(area)
        self._device.write_at(start + self._geometry.block_align, body)
        self._device.write_at(start, self._header(seq, body))
        self._device.sync()
        self.seq, self._area = seq, area
        # It outranks every header read; an area whose header could not be read may hold
        # any number until it is overwritten too (both unread: the second write).
        self._unread.discard(area)
        self.newer_passed_over = bool(self._unread)
        return len(body)

    def invalidate(self) -> None:
        """Blank both headers (formatting): no checkpoint of an earlier format survives."""
        for area in (0, 1):
            self._device.write_at(self._geometry.area_offset(area), b"")
        self.seq, self._area = 0, 1
        self._unread.clear()
        self.newer_passed_over = False
