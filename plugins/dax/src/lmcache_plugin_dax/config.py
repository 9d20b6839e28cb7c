"""Configuration of the ``dax`` adapter, with LMCache's field names and meanings.

Imported whenever plugins are listed: no I/O and no heavy imports here.  Whether a path
can be opened and mapped is checked when the adapter starts, with a one-line error.
"""

from __future__ import annotations

import os
from typing import Annotated, ClassVar

import msgspec
from lmcache_plugin_raw_block.config import LookupWorkers, lmcache_field

from lmcache_plugin_dax.layout import mapped_bytes, plan_layout
from lmcache_tiers.plugin import ComponentConfig, FieldError, L2AdapterConfig, SizeGiB


class DaxDevice(ComponentConfig):
    """One mapped device or file of a ``dax`` adapter."""

    device_path: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            description=lmcache_field(
                "A device DAX node (/dev/daxX.Y) or a regular file (created, or extended and "
                "preallocated, to max_dax_size_gb; never created under /dev but /dev/shm)."
            ),
        ),
    ]
    max_dax_size_gb: Annotated[
        SizeGiB,
        msgspec.Meta(gt=0.0, description=lmcache_field("GiB of it to map (index and slots together).")),
    ]


class DaxConfig(L2AdapterConfig):
    """Objects in fixed-size slots of memory-mapped DAX devices (persistent memory, CXL
    memory) or files, mapped shared.

    Each mapping starts with a superblock and a small index -- one entry per slot
    holding the slot's key, sizes and record header, committed after the slot's bytes
    are written -- so a restart finds every committed object again (LMCache's dax starts
    empty). Copies in and out of slots run without the GIL. Usage is the fraction of
    slots in use; deletes (eviction included) free slots, and a slot being read is
    reused only after its readers finish. An object larger than slot_bytes is refused
    and counted (object_too_large). Give one mapping as device_path and max_dax_size_gb,
    or several as devices; slots are spread over them in turn.
    """

    #: LMCache's dax fields without an equivalent here -> why
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "hotplug_enabled": "devices are fixed at start-up; there is no API adding or removing them",
    }

    slot_bytes: Annotated[
        int,
        msgspec.Meta(gt=0, description=lmcache_field("Size of one slot: the largest object stored.")),
    ]
    device_path: Annotated[
        str | None,
        msgspec.Meta(description=lmcache_field("The one mapping, with max_dax_size_gb (or use devices).")),
    ] = None
    max_dax_size_gb: Annotated[
        Annotated[SizeGiB, msgspec.Meta(gt=0.0)] | None,
        msgspec.Meta(description=lmcache_field("GiB of device_path to map.")),
    ] = None
    devices: Annotated[
        tuple[DaxDevice, ...],
        msgspec.Meta(description=lmcache_field("Several mappings, each {device_path, max_dax_size_gb}.")),
    ] = ()
    persist_enabled: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "lmcache-tiers addition. Recover committed objects at start-up; false starts "
                "empty, as LMCache's dax does."
            )
        ),
    ] = True
    num_store_workers: Annotated[
        Annotated[int, msgspec.Meta(gt=0, le=64)] | None,
        msgspec.Meta(
            description=lmcache_field("Threads copying the objects of one store batch; null: min(2, CPUs).")
        ),
    ] = None
    num_load_workers: Annotated[
        Annotated[int, msgspec.Meta(gt=0, le=64)] | None,
        msgspec.Meta(
            description=lmcache_field(
                "Threads copying and verifying the objects of one load batch; null: min(4, CPUs)."
            )
        ),
    ] = None
    num_lookup_workers: LookupWorkers = 1

    def __post_init__(self) -> None:
        if self.devices and (self.device_path is not None or self.max_dax_size_gb is not None):
            raise FieldError("devices", "give either devices or device_path with max_dax_size_gb, not both")
        if not self.devices:
            for name in ("device_path", "max_dax_size_gb"):
                if getattr(self, name) is None:
                    raise FieldError(name, f"{name} is required (or list the mappings in devices)")
            if not self.device_path:
                raise FieldError("device_path", "device_path must not be empty")
        seen: set[str] = set()
        for index, device in enumerate(self.mappings()):
            prefix = f"devices[{index}]." if self.devices else ""
            if (
                plan_layout(mapped_bytes(device.max_dax_size_gb, device=False), self.slot_bytes).slot_count
                < 1
            ):
                raise FieldError(
                    f"{prefix}max_dax_size_gb",
                    f"{device.max_dax_size_gb} GiB of {device.device_path} cannot hold its index "
                    f"and one slot of {self.slot_bytes} bytes",
                )
            path = os.path.normpath(device.device_path)
            if path in seen:
                raise FieldError(f"{prefix}device_path", f"{device.device_path} is listed twice")
            seen.add(path)

    def mappings(self) -> tuple[DaxDevice, ...]:
        """Every configured mapping, whichever way it was given."""
        if self.devices:
            return self.devices
        assert self.device_path is not None and self.max_dax_size_gb is not None
        return (DaxDevice(device_path=self.device_path, max_dax_size_gb=self.max_dax_size_gb),)

    @property
    def store_workers(self) -> int:
        # Two: one thread copying and hashing reached 0.74-0.81x of a one-thread memcpy,
        # two overlap one's hashing with the other's copy (bench/bench_block.py).
        return self.num_store_workers or min(2, os.cpu_count() or 1)

    @property
    def load_workers(self) -> int:
        return self.num_load_workers or min(4, os.cpu_count() or 1)
