import sys
from pathlib import Path

# Shared helpers for the cross-package tests (imported by name under importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
