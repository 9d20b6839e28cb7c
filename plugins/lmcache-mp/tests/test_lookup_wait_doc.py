"""Why a lookup that goes to L2 waits up to ``lookup_wait_ms`` before it answers: so the
client's first status query already has the hit count.  The page said LMCache's clients
poll every 50 ms; only its bench does (its first query right after the lookup's reply).
vLLM's connector in 0.5.6 sends ``query_prefetch_status`` only once the lookup is answered
(a status query overtaking the lookup would read 0 hits) and then once per scheduler step,
so the wait serves it the same way.  docs/frontends/lmcache-mp.md says which client does
what.
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "frontends" / "lmcache-mp.md"


def test_the_page_tells_the_bench_and_the_connector_apart() -> None:
    text = " ".join(DOC.read_text().split())
    start = text.index("**Lookups that go to L2**")
    paragraph = text[start : text.index("* **Liveness**", start)]
    assert "clients poll every 50 ms" not in paragraph
    assert "bench queries at once and then every 50 ms" in paragraph
    assert "once the lookup is answered" in paragraph and "per scheduler step" in paragraph
