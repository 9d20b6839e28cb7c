"""The suite's DETECTS_DAMAGE test: it passes for a backend whose loads verify records and
remove damaged ones, and names the defect of one that hands out a damaged object or
keeps offering it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from l2_backends import _SPACES, DictBackend, DictConfig

from lmcache_tiers.cli.plugins_new import SkeletonKind, write_plugin
from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter, create_adapter
from lmcache_tiers.plugin import DETECTS_DAMAGE, L2AdapterSuite
from lmcache_tiers.testing.l2_support import BufferPool, page_aligned_buffer

NAME = "test_a_damaged_object_is_never_loaded"


class _SuiteOn(L2AdapterSuite):
    """The suite on one record-keeping dict backend class, damage done in its dict."""

    component_name = "test_dict"
    capabilities = frozenset({DETECTS_DAMAGE})

    def __init__(self, backend: type[DictBackend]) -> None:
        self.backend = backend
        self.namespace = uuid.uuid4().hex

    def make_config(self) -> DictConfig:
        return DictConfig(namespace=self.namespace, capacity=256 << 10, records=True)

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        return create_adapter(self.backend, config, self.make_context(config, l1_buffer))

    def damage_stored(self, adapter: L2Adapter, key: ObjectKey) -> None:
        record = bytearray(_SPACES[self.namespace][key])
        record[-1] ^= 0xFF  # the payload's last byte: the header still reads
        _SPACES[self.namespace][key] = bytes(record)


def run_damage_test(backend: type[DictBackend]) -> None:
    suite = _SuiteOn(backend)
    l1_buffer = page_aligned_buffer(suite.l1_buffer_size)
    adapter = suite.open_adapter(suite.make_config(), l1_buffer)
    try:
        getattr(suite, NAME)(adapter, BufferPool(l1_buffer))
    finally:
        adapter.close()


class LoadsWithoutVerifying(DictBackend):
    """Reads the header but hands out the payload without checking it."""

    def _payload(self, key: ObjectKey, value: bytes) -> bytes | None:
        header = self.context.read_record_header(value, key)
        return None if header is None else value[header.header_len :]


class KeepsDamagedRecords(DictBackend):
    """Fails the load of a damaged record but leaves it in place, found again next time."""

    def _drop_corrupt(self, key: ObjectKey) -> None:
        self.context.count("corrupt_records_removed")


def test_a_backend_verifying_and_removing_damaged_records_passes() -> None:
    run_damage_test(DictBackend)


def test_a_load_handing_out_damaged_bytes_is_named() -> None:
    with pytest.raises(AssertionError, match="succeeded with the damaged bytes: verify what a load reads"):
        run_damage_test(LoadsWithoutVerifying)


def test_a_damaged_record_left_in_place_is_named() -> None:
    with pytest.raises(AssertionError, match="still found the damaged object: remove a damaged record"):
        run_damage_test(KeepsDamagedRecords)


def test_a_suite_declaring_it_without_damage_stored_is_told() -> None:
    class Undamaging(L2AdapterSuite):
        component_name = "test_dict"
        capabilities = frozenset({DETECTS_DAMAGE})

    with pytest.raises(
        NotImplementedError, match="declares DETECTS_DAMAGE but does not override damage_stored"
    ):
        Undamaging().damage_stored(None, None)  # type: ignore[arg-type]


def test_the_generated_l2_test_names_it(tmp_path: Path) -> None:
    package = write_plugin("my-store", SkeletonKind.L2, tmp_path)
    text = (package / "tests" / "test_my_store.py").read_text()
    assert "declares DETECTS_DAMAGE and overrides damage_stored(self, adapter, key)" in text
