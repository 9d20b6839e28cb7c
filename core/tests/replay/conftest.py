import sys
from pathlib import Path

import pytest

# Helpers shared by the replay tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

from replay_support import synthetic_lines, write_trace

from lmcache_tiers.replay.trace import Trace, read_trace


@pytest.fixture
def synthetic_trace(tmp_path: Path) -> Trace:
    return read_trace(write_trace(tmp_path / "trace.jsonl", synthetic_lines(7)))
