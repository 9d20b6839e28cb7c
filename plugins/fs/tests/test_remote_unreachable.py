"""An fsspec store that refuses the connection when the adapter opens it: the start-up
fails with one line naming the adapter and the store (its password left out)."""

from __future__ import annotations

import pytest
from fs_helpers import fs_config, open_fs

from lmcache_tiers.plugin import BackendUnavailableError, free_port

SECRET = "s3cr3t-pw"


def test_a_store_refusing_the_connection_names_the_adapter_and_the_url() -> None:
    root = f"ftp://reader:{SECRET}@127.0.0.1:{free_port()}/kv"  # nothing listens there
    with pytest.raises(BackendUnavailableError) as caught:
        open_fs(fs_config(root))
    told = str(caught.value)
    assert told.startswith("fs: cannot reach ftp://reader:***@127.0.0.1:"), told
    assert "Connection refused" in told
    assert SECRET not in told
    assert "\n" not in told


def test_a_tree_that_cannot_be_listed_fails_the_start() -> None:
    # fsspec's generic listing leaves out a directory it cannot list: the store would
    # start as if empty, its records neither accounted nor swept.
    root = f"http://127.0.0.1:{free_port()}/kv"  # nothing listens there
    with pytest.raises(OSError, match=r"^0:fs-test: cannot list http://127\.0\.0\.1:\d+/kv: "):
        open_fs(fs_config(root))
