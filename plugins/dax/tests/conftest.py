import sys
from pathlib import Path

# Helper modules of these tests, and raw_block's shared slot-store test helpers (dax is
# built on raw_block), imported by name under pytest's importlib mode.
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "raw-block" / "tests"))
sys.path.insert(0, str(HERE))
