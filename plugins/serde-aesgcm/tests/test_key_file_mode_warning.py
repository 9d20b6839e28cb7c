"""A key file others can read is warned about once: start-up reads each key twice (its
checks, then the serde it builds), and each read logged the same warning."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lmcache_plugin_serde_aesgcm import AesGcmConfig
from lmcache_plugin_serde_aesgcm.cipher import AesGcmSerde

WARNING = "is accessible to group or others"


def warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if WARNING in record.getMessage()]


def test_a_key_file_open_to_others_is_warned_about_once_per_mode(tmp_path: Path, caplog) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o644)
    config = AesGcmConfig(key_file=str(key_file))
    with caplog.at_level(logging.WARNING):
        AesGcmSerde(config)
        AesGcmSerde(config)
    assert len(warnings(caplog)) == 1, warnings(caplog)
    assert "mode 644" in warnings(caplog)[0]

    key_file.chmod(0o640)  # another mode is news: said again
    with caplog.at_level(logging.WARNING):
        AesGcmSerde(config)
        AesGcmSerde(config)
    assert len(warnings(caplog)) == 2, warnings(caplog)
    assert "mode 640" in warnings(caplog)[1]
