import sys
from pathlib import Path

# Helper modules shared by the core tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
