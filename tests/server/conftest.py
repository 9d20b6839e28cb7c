import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Client jobs run in spawned processes, which import tiers_e2e by name from sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from tiers_e2e import ServerProcess, start_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server subprocess with an L1 of 256 MiB and no L2; stopped (and checked) after."""
    proc = start_server(tmp_path / "server")
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()
    assert not proc.shm_path.exists(), "the L1 segment outlived the server"


@pytest.fixture
def server_with_l2(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose L2 is the mock adapter (in the server's memory)."""
    proc = start_server(tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.5}])
    yield proc
    code = proc.stop()
    assert code == 0, proc.output()
    assert not proc.shm_path.exists(), "the L1 segment outlived the server"
