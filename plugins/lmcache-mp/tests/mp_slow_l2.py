"""The L2 of the LMCache front end's tests that need a prefetch still running when their
next request comes."""

from __future__ import annotations

import json

#: an L2 whose lookups and loads take a second: a lookup's prefetch is still running while
#: the test's next request arrives (its stores are not slowed: the flush that puts the
#: chunks in L2 does not wait)
SLOW_L2 = [
    json.dumps(
        {
            "type": "fault_inject",
            "inner": {"type": "mock", "max_size_gb": 0.1},
            "delay_s": 1.0,
            "delay_ops": ["lookup", "load"],
        }
    )
]
