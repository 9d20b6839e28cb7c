"""docs/plugin-guide.md tells a persistent backend to log the damaged records it removes.

The rule a backend applies to a record it read back (``BackendContext.kept_record``)
counts and logs the records it keeps; a damaged one is removed and counted by the
backend, and the project's rule is that every corruption is also explained in a log
line, which only the backend can write (the shipped ones warn "damaged").  A backend
written from the guide alone removed damaged records without a word.
"""

from __future__ import annotations

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-guide.md"


def guide_text() -> str:
    return re.sub(r"\s+", " ", GUIDE.read_text())


def test_the_kept_record_row_says_to_log_a_damaged_record() -> None:
    [row] = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `kept_record(")]
    damage = row[row.index("False for damage") :]
    assert '`count("corrupt_records_removed")`' in damage
    assert '`warn("damaged", ...)`' in damage, damage


def test_the_persistent_backends_rule_says_to_log_a_damaged_record() -> None:
    text = guide_text()
    start = text.index("a damaged one (`DAMAGED`) is a miss that is **removed**")
    sentence = text[start : text.index("Call `context.kept_record", start)]
    assert "logged by the backend (`context.warn`" in sentence, sentence
