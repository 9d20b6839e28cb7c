import sys
from pathlib import Path

from lmcache_tiers.testing.children import processes

__all__ = ["processes"]

# Helper modules shared by the core tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
