"""The segment LMCache clients are told about: a POSIX shared-memory name, which they open
in /dev/shm, so an arena elsewhere (``--shm-dir``) is refused at start-up unless chunks
travel pickled."""

from __future__ import annotations

import pytest
from lmcache_plugin_lmcache_mp import LMCacheMPConfig

from lmcache_tiers.config import ServerConfig
from lmcache_tiers.errors import ConfigError


def test_an_arena_outside_dev_shm_is_refused_in_one_line() -> None:
    server = ServerConfig(l1_shm_dir="/mnt/lmcache-l1")
    with pytest.raises(ConfigError) as caught:
        LMCacheMPConfig().check(server, None)
    message = str(caught.value)
    assert "\n" not in message
    assert "LMCache clients open in /dev/shm" in message and "--shm-dir /mnt/lmcache-l1" in message
    assert '"allow_pickle": true' in message


@pytest.mark.parametrize("directory", ["/dev/shm", "/dev/shm/", "/dev/../dev/shm"])
def test_dev_shm_however_spelled_is_accepted(directory: str) -> None:
    LMCacheMPConfig().check(ServerConfig(l1_shm_dir=directory), None)


def test_pickled_chunks_need_no_segment_anywhere() -> None:
    pytest.importorskip("torch", reason="allow_pickle needs torch on the server")
    LMCacheMPConfig(shm=False, allow_pickle=True).check(ServerConfig(l1_shm_dir="/mnt/lmcache-l1"), None)


def test_no_segment_at_all_is_not_about_the_directory() -> None:
    pytest.importorskip("torch", reason="allow_pickle needs torch on the server")
    server = ServerConfig(l1_shm_dir="/mnt/lmcache-l1", no_shm=True)
    LMCacheMPConfig(allow_pickle=True).check(server, None)


def test_no_segment_without_pickled_chunks_names_every_flag_that_turns_it_off() -> None:
    """LMCache's own server reads ``--shm-name ""`` as "no segment" too: a command line
    carried over with it is told that this is why the front end cannot start."""
    with pytest.raises(ConfigError) as caught:
        LMCacheMPConfig().check(ServerConfig(no_shm=True), None)
    message = str(caught.value)
    assert "\n" not in message and '"allow_pickle": true' in message
    assert all(flag in message for flag in ("--no-shm", '--shm-name ""', "--gds-l1-path")), message
