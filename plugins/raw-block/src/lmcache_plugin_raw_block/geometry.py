"""Where everything lies on a ``raw_block`` device.

``[0, block_align)`` superblock | checkpoint area A | checkpoint area B | slot 0 | slot 1 ...

The metadata region is ``meta_total_bytes`` long (LMCache's meaning: the first slot starts
there); the two checkpoint areas split what follows the superblock.  Every offset and
length is a multiple of ``block_align``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lmcache_plugin_raw_block.aligned import round_up
from lmcache_plugin_raw_block.config import META_BYTES_PER_SLOT, META_MIN_AREA_BYTES, RawBlockConfig
from lmcache_tiers.plugin import ConfigError


@dataclass(frozen=True)
class Geometry:
    block_align: int
    slot_bytes: int
    header_bytes: int
    meta_total_bytes: int
    area_bytes: int
    slot_count: int
    used_bytes: int  # bytes of the device the layout covers

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - self.header_bytes

    def area_offset(self, area: int) -> int:
        return self.block_align + area * self.area_bytes

    def slot_offset(self, slot: int) -> int:
        return self.meta_total_bytes + slot * self.slot_bytes


def plan_geometry(config: RawBlockConfig, device_bytes: int) -> Geometry:
    """The layout of ``config`` on a device of ``device_bytes`` (ConfigError if no slot fits)."""
    align = config.block_align
    usable = min(config.capacity_bytes or device_bytes, device_bytes)
    if config.meta_total_bytes is not None:
        meta = config.meta_total_bytes
        area = (meta - align) // 2 // align * align
    else:
        estimate = max(0, (usable - align) // config.slot_bytes)
        area = round_up(max(META_MIN_AREA_BYTES, align + estimate * META_BYTES_PER_SLOT), align)
        meta = align + 2 * area
    slot_count = (usable - meta) // config.slot_bytes if usable > meta else 0
    if slot_count < 1:
        raise ConfigError(
            f"raw_block: {config.device_path} has {usable} usable bytes, too few for "
            f"{meta} bytes of metadata and one slot of {config.slot_bytes}"
        )
    return Geometry(
        block_align=align,
        slot_bytes=config.slot_bytes,
        header_bytes=config.header_bytes,
        meta_total_bytes=meta,
        area_bytes=area,
        slot_count=slot_count,
        used_bytes=meta + slot_count * config.slot_bytes,
    )
