"""``--shm-name NAME`` names the L1 segment ``/dev/shm/NAME`` and registration answers that
name as it is.  LMCache's server takes the same flag but names its segment
``lmcache_l1_pool_NAME`` (it adds the prefix unless the name has it), so the flag is not the
same in every respect: clients are told the name either way, but an operator's scripts that
look for ``/dev/shm/lmcache_l1_pool_NAME`` find nothing.  docs/lmcache-compat.md says so.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

from mpclient import MPClient, Registration, mp_address

from lmcache_tiers.server.app import TiersServer

COMPAT = Path(__file__).resolve().parents[3] / "docs" / "lmcache-compat.md"


def test_registration_answers_the_segment_name_as_given(make_server: Callable[..., TiersServer]) -> None:
    name = f"tiers_named_{uuid.uuid4().hex[:10]}"
    server = make_server(frontends=[{"type": "lmcache_mp"}], l1_shm_name=name)
    with MPClient(mp_address(server)) as client:
        assert client.register(Registration())["shm_name"] == name
    assert Path("/dev/shm", name).exists()
    assert not Path("/dev/shm", f"lmcache_l1_pool_{name}").exists()


def test_the_compat_table_says_lmcache_prefixes_the_segment_name() -> None:
    rows: list[str] = re.findall(r"^\| `--shm-name` \|.*$", COMPAT.read_text(), flags=re.MULTILINE)
    (row,) = rows
    assert "`lmcache_l1_pool_<name>`" in row and "`/dev/shm/<name>`" in row
