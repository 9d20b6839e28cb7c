import pytest

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.replay.capacity import extent_bytes, l1_size_for_blocks, parse_capacity


@pytest.mark.parametrize(
    ("text", "blocks", "size"),
    [
        ("1000", 1000, None),
        ("4k", 4000, None),
        ("1.5K", 1500, None),
        ("2m", 2_000_000, None),
        ("512MiB", None, 512 << 20),
        ("2GB", None, 2 * 10**9),
        ("64 KiB", None, 64 << 10),
        ("100b", None, 100),
    ],
)
def test_capacities_parse(text: str, blocks: int | None, size: int | None) -> None:
    capacity = parse_capacity(text)
    assert (capacity.blocks, capacity.bytes) == (blocks, size)


@pytest.mark.parametrize("text", ["", "abc", "-5", "0", "4 parsecs", "0.1", "1..2k"])
def test_bad_capacities_are_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match="bad capacity"):
        parse_capacity(text)


@pytest.mark.parametrize(
    "text",
    ["9" * 400, "9" * 5000, "1." + "0" * 5000 + "1k", "10000000000000000000TiB"],
    ids=["400 digits", "5000 digits", "5000 decimals", "10**19 TiB"],
)
def test_capacities_no_machine_holds_are_one_clear_error(text: str) -> None:
    # Once an OverflowError from the simulator's float arithmetic, or a ValueError from
    # reading a number of more than 4300 digits.
    with pytest.raises(ConfigError, match="bad capacity"):
        parse_capacity(text)


@pytest.mark.parametrize(
    ("blocks", "block_bytes"),
    [(10**400, 8192), (2, 10**400), (1 << 60, 1 << 20)],
    ids=["10**400 blocks", "10**400 bytes a block", "2**80 bytes"],
)
def test_l1_for_blocks_no_machine_holds_is_one_clear_error(blocks: int, block_bytes: int) -> None:
    with pytest.raises(ConfigError, match="no machine"):
        l1_size_for_blocks(blocks, block_bytes)


def test_byte_capacities_count_aligned_extents() -> None:
    assert extent_bytes(5000, 4096) == 8192
    assert parse_capacity("1MiB").in_blocks(extent_bytes(5000, 4096)) == 128


@pytest.mark.parametrize(
    ("blocks", "block_bytes"), [(1, 8192), (1000, 8192), (333, 5000), (64, 4096), (10, 200)]
)
def test_l1_for_blocks_holds_exactly_that_many_and_is_never_full(blocks: int, block_bytes: int) -> None:
    size_gb, align = l1_size_for_blocks(blocks, block_bytes)
    allocator = ExtentAllocator(int(size_gb * (1 << 30)), align)
    assert allocator.allocate_many([block_bytes] * blocks) is not None
    assert allocator.allocate_many([block_bytes]) is None
    assert allocator.allocated_bytes / allocator.capacity < 1.0


def test_l1_for_blocks_refuses_nonsense() -> None:
    with pytest.raises(ConfigError):
        l1_size_for_blocks(0, 8192)
    with pytest.raises(ConfigError):
        l1_size_for_blocks(10, 64)
