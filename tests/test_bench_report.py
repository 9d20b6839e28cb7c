"""bench/run_all.py: every benchmark's JSON read as printed, tables built from it, and a
benchmark that fails or cannot run reported as such without stopping the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_modules import load_bench

run_all = load_bench("run_all")


def test_the_last_json_document_is_read_after_progress_lines() -> None:
    assert run_all.last_json('{"a": 1}') == {"a": 1}
    assert run_all.last_json('progress 1/3\nprogress {2}\n[{"x": 2.5}]\n') == [{"x": 2.5}]
    with pytest.raises(ValueError):
        run_all.last_json("no figures here")


def test_rows_flatten_one_level_and_leave_samples_to_the_json() -> None:
    figures = [{"case": "64x1", "ratio": 0.8, "p50": {"store": 1.5}, "runs": list(range(50)), "pair": [1, 2]}]
    [(title, rows)] = run_all.tables_of(figures)
    assert title == ""
    assert rows == [{"case": "64x1", "ratio": 0.8, "p50.store": 1.5, "pair": "1 / 2"}]
    table = run_all.markdown_table(rows)
    assert table.splitlines()[0] == "| case | ratio | p50.store | pair |"
    assert "| 64x1 | 0.8 | 1.5 | 1 / 2 |" in table


def test_lists_of_records_inside_a_record_are_tables_of_their_own() -> None:
    """A comparison's rows, a benchmark's cases with their results, records in a record's
    dict: each a table titled by its path; rows of several parents say which parent."""
    figures = {
        "trace": "t.jsonl",
        "rows": [{"figure": "store", "p99": 2.5, "samples": list(range(16))}],
        "study": {
            "whole": [{"capacity": 1000, "miss": {"LRU": 0.9}}],
            "halves": {"first": [{"capacity": 5}]},
        },
    }
    tables = run_all.tables_of(figures)
    assert tables == [
        ("", [{"trace": "t.jsonl"}]),
        ("rows", [{"figure": "store", "p99": 2.5}]),
        ("study.whole", [{"capacity": 1000, "miss.LRU": 0.9}]),
        ("study.halves.first", [{"capacity": 5}]),
    ]
    cases = [
        {
            "case": "256 x 1 MiB",
            "results": [{"method": "direct", "gbps": 1.0}, {"method": "adapter", "gbps": 0.9}],
        },
        {"case": "64 x 16 MiB", "results": [{"method": "direct", "gbps": 2.0}]},
    ]
    assert run_all.tables_of(cases) == [
        ("", [{"case": "256 x 1 MiB"}, {"case": "64 x 16 MiB"}]),
        (
            "results",
            [
                {"case": "256 x 1 MiB", "method": "direct", "gbps": 1.0},
                {"case": "256 x 1 MiB", "method": "adapter", "gbps": 0.9},
                {"case": "64 x 16 MiB", "method": "direct", "gbps": 2.0},
            ],
        ),
    ]


def test_failures_and_skips_are_reported_and_the_rest_still_runs(tmp_path: Path) -> None:
    ok = tmp_path / "bench_ok.py"
    ok.write_text("import json\nprint('warming up')\nprint(json.dumps({'figure': 1.25}))\n")
    bad = tmp_path / "bench_bad.py"
    bad.write_text("import sys\nsys.exit('cannot reach the redis server')\n")
    run_all.BENCH_DIR = tmp_path
    outcomes = [
        run_all.run_bench(run_all.Bench("bad", "bench_bad.py"), False, tmp_path),
        run_all.run_bench(run_all.Bench("ref", "bench_ok.py", needs_reference=True), False, tmp_path),
        run_all.run_bench(run_all.Bench("ok", "bench_ok.py"), False, tmp_path),
    ]
    assert outcomes[0].error.startswith("exit 1: cannot reach the redis server")
    assert "has no lmcache" in outcomes[1].skipped
    assert outcomes[2].figures == {"figure": 1.25} and not outcomes[2].error
    markdown, data = run_all.write_report(outcomes, {"before": [0.1], "after": [0.2]}, tmp_path / "report")
    text = markdown.read_text()
    assert "Failed: exit 1: cannot reach the redis server" in text and "Skipped:" in text
    assert "| 1.25 |" in text
    assert json.loads(data.read_text())["benchmarks"]["ok"]["figures"] == {"figure": 1.25}
