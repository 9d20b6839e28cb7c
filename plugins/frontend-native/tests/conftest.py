"""In-process servers (real StorageManager, L1 only unless told) on a thread; end-to-end
tests with separate processes live in tests/server."""

import sys
from pathlib import Path

from lmcache_tiers.testing.children import processes
from lmcache_tiers.testing.server import make_server, server

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))

__all__ = ["make_server", "processes", "server"]
