import sys
from pathlib import Path

from lmcache_tiers.testing.threads import new_threads

__all__ = ["new_threads"]

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
