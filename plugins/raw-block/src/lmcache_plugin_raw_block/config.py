"""Configuration of the ``raw_block`` adapter, with LMCache's field names and meanings.

Imported whenever plugins are listed: no I/O and no heavy imports here.  Checks that
need the device (its size, its logical block size, whether it takes ``O_DIRECT``) are
made when the adapter opens it, each with a one-line error as well.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from lmcache_tiers.plugin import FieldError, L2AdapterConfig

_MIB = 1 << 20
#: checkpoint bytes budgeted per slot when meta_total_bytes is left to the adapter
META_BYTES_PER_SLOT = 512
#: and a floor, so small devices still get room for a few long keys
META_MIN_AREA_BYTES = 64 << 10
#: the largest slot or capacity taken (1 EiB): past 2**63 the system calls cannot take
#: the length (posix_fallocate raised OverflowError at start-up)
MAX_BYTES = 1 << 60
#: the longest checkpoint interval taken (a year): the checkpoint thread waits that long,
#: and a wait past threading.TIMEOUT_MAX raised there, ending the periodic checkpoints
MAX_CHECKPOINT_INTERVAL_S = 365 * 86400


def lmcache_field(text: str) -> str:
    """A field description marking the field as LMCache's own (``plugins show`` says so)."""
    return f"LMCache field. {text}"


#: LMCache's ``num_lookup_workers`` of the slot stores, accepted so its JSON works as is
LookupWorkers = Annotated[
    int,
    msgspec.Meta(
        gt=0,
        le=64,
        description=lmcache_field(
            "Accepted for LMCache configs; lookups are answered from the in-memory index "
            "without I/O, so it changes nothing."
        ),
    ),
]


class RawBlockConfig(L2AdapterConfig):
    """Objects in fixed-size slots of a block device or a preallocated regular file.

    The device starts with a superblock (identity and geometry) and two checkpoint areas
    written in turn; then come ``slot_bytes`` slots, each a ``header_bytes`` header naming
    its key and carrying the payload checksum, then the payload. An object larger than a
    slot's payload (``slot_bytes - header_bytes``) is refused and counted
    (``object_too_large``). Usage is the fraction of slots in use; deletes, eviction
    included, free slots. After a restart the newest valid checkpoint is read and checked
    against the slot headers, and slots written after it are recovered from their
    headers; every load verifies the header and the payload checksum, so a damaged slot
    is a miss, never wrong bytes. A device that holds a filesystem, a partition table or a
    dax mapping is refused rather than formatted.
    """

    #: LMCache's raw_block fields without an equivalent here -> why
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        **dict.fromkeys(
            ("io_engine", "use_iouring", "use_uring", "use_uring_cmd", "iouring_queue_depth"),
            "slots are read and written with positioned POSIX I/O; there is no io_uring engine",
        ),
        **dict.fromkeys(
            (
                "fdp_enabled",
                "fdp_placement_ids",
                "fdp_data_placement_policy",
                "fdp_slot_reuse_policy",
                "meta_checkpoint_placement_id",
            ),
            "there are no NVMe flexible data placement hints",
        ),
        "max_data_transfer_size": "each slot is one I/O of at most slot_bytes",
        "enable_zero_copy": "buffers are aligned whenever use_odirect needs it; there is nothing to switch",
        "meta_magic": "the superblock format is this adapter's own, with a fixed magic",
        "meta_version": "the superblock format is this adapter's own, with a fixed version",
        "meta_idle_quiet_ms": "checkpoints follow meta_checkpoint_interval_sec only",
        "per_tp_device_paths": "one server holds all ranks' objects on device_path",
        "persist_enabled": "objects on the device are always kept (true is accepted); "
        "load_checkpoint_on_init false starts empty",
    }
    #: LMCache's raw_block requires persist_enabled true: what this adapter always does
    lmcache_neutral_values: ClassVar[dict[str, object]] = {"persist_enabled": True}

    device_path: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            description=lmcache_field(
                "Block device (e.g. /dev/nvme1n1) or regular file holding the slots. A regular "
                "file shorter than capacity_bytes is extended and preallocated."
            ),
        ),
    ]
    slot_bytes: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            le=MAX_BYTES,
            description=lmcache_field("Size of one slot, header included; a multiple of block_align."),
        ),
    ]
    capacity_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=MAX_BYTES,
            description=lmcache_field(
                "Bytes of the device to use, metadata included; 0 uses the whole device "
                "(a block device smaller than this is used whole, with a warning)."
            ),
        ),
    ] = 0
    use_odirect: Annotated[
        bool,
        msgspec.Meta(description=lmcache_field("Open the device with O_DIRECT (no page cache).")),
    ] = True
    block_align: Annotated[
        int,
        msgspec.Meta(
            ge=512,
            le=_MIB,
            description=lmcache_field(
                "Alignment of every offset and length, a power of two no smaller than the "
                "device's logical block size."
            ),
        ),
    ] = 4096
    header_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=512,
            description=lmcache_field(
                "Bytes reserved at the start of each slot for its header; a multiple of "
                "block_align. A key whose header does not fit is not stored (header_too_large)."
            ),
        ),
    ] = 4096
    meta_total_bytes: Annotated[
        int | None,
        msgspec.Meta(
            description=lmcache_field(
                "Bytes before the first slot: the superblock and two checkpoint areas; a "
                f"multiple of block_align. null (lmcache-tiers' default; LMCache's is 256 MiB) "
                f"sizes it for the slot count: each area a header block and {META_BYTES_PER_SLOT} "
                f"bytes per slot, at least {META_MIN_AREA_BYTES >> 10} KiB, rounded up to block_align."
            )
        ),
    ] = None
    meta_checkpoint_interval_sec: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            le=MAX_CHECKPOINT_INTERVAL_S,
            description=lmcache_field(
                "Seconds between checkpoints of the slot index (written only when something "
                "changed, and always at shutdown)."
            ),
        ),
    ] = 60
    meta_enable_periodic: Annotated[
        bool,
        msgspec.Meta(
            description=lmcache_field(
                "Write checkpoints periodically; false writes one at start-up and shutdown only "
                "(recovery after a crash then reads more slot headers)."
            )
        ),
    ] = True
    load_checkpoint_on_init: Annotated[
        bool,
        msgspec.Meta(
            description=lmcache_field(
                "Recover the objects on the device at start-up; false starts empty (the "
                "device is reformatted)."
            )
        ),
    ] = True
    meta_verify_on_load: Annotated[
        bool,
        msgspec.Meta(
            description=lmcache_field(
                "Check every checkpointed slot's header at start-up; false trusts the "
                "checkpoint (loads still verify each header and payload)."
            )
        ),
    ] = True
    num_store_workers: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            le=64,
            description=lmcache_field("Threads writing the slots of one store batch in parallel."),
        ),
    ] = 2
    num_load_workers: Annotated[
        int,
        msgspec.Meta(
            gt=0,
            le=64,
            description=lmcache_field(
                "Threads reading and verifying the slots of one load batch in parallel."
            ),
        ),
    ] = 4
    num_lookup_workers: LookupWorkers = 1

    def __post_init__(self) -> None:
        align = self.block_align
        if align & (align - 1):
            raise FieldError("block_align", f"block_align must be a power of two, got {align}")
        for name in ("slot_bytes", "header_bytes"):
            value = getattr(self, name)
            if value % align:
                raise FieldError(name, f"{name} ({value}) must be a multiple of block_align ({align})")
        if self.slot_bytes <= self.header_bytes:
            raise FieldError(
                "slot_bytes",
                f"slot_bytes ({self.slot_bytes}) must exceed header_bytes ({self.header_bytes}) "
                "to leave room for a payload",
            )
        meta = self.meta_total_bytes
        if meta is not None:
            # Each checkpoint area is a header block and at least one block of body: with
            # less, no checkpoint ever fits and every restart reads every slot header.
            if meta % align or meta < 5 * align:
                raise FieldError(
                    "meta_total_bytes",
                    f"meta_total_bytes ({meta}) must be a multiple of block_align ({align}) "
                    f"and at least 5 blocks ({5 * align}): a superblock and two checkpoint areas "
                    "of a header block and a body block each",
                )
            if 0 < self.capacity_bytes < meta + self.slot_bytes:
                raise FieldError(
                    "capacity_bytes",
                    f"capacity_bytes ({self.capacity_bytes}) leaves no room for a slot after "
                    f"meta_total_bytes ({meta}); it needs at least {meta + self.slot_bytes}",
                )
        elif 0 < self.capacity_bytes < self.slot_bytes + 3 * align:
            raise FieldError(
                "capacity_bytes",
                f"capacity_bytes ({self.capacity_bytes}) cannot hold a slot of {self.slot_bytes} "
                "bytes next to the metadata",
            )

    @property
    def payload_bytes(self) -> int:
        """The largest object a slot holds."""
        return self.slot_bytes - self.header_bytes
