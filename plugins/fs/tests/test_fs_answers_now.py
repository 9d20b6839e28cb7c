"""fs says whether it answers lookups at once: on a local directory (misses told from
memory), never on a remote root, where every lookup goes to its worker -- so that a front
end does not prepare lookups for a first question that would never be answered."""

from __future__ import annotations

import os
from pathlib import Path

from fs_helpers import fs_config, open_fs


def test_a_local_directory_answers_lookups_at_once(tmp_path: Path) -> None:
    adapter = open_fs(fs_config(str(tmp_path)))
    try:
        assert adapter.answers_lookups_now
    finally:
        adapter.close()


def test_a_remote_root_does_not() -> None:
    adapter = open_fs(fs_config(f"memory://answers-now-{os.getpid()}"))
    try:
        assert not adapter.answers_lookups_now
    finally:
        adapter.close()
