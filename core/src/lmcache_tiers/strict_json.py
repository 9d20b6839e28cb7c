"""Status documents as strict JSON.

A backend's stat may be NaN or infinite; ``json.dumps`` writes those as ``NaN`` and
``Infinity``, which JSON readers (JavaScript, Go, jq) refuse, so one bad stat would cost
the whole document.  They become ``null`` here.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def strict_json(document: Any, indent: int | None = None) -> str:
    """``document`` as JSON a strict reader takes (values JSON lacks become strings)."""
    return json.dumps(finite(document), indent=indent, default=str, allow_nan=False)
