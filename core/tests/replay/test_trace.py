import json
from pathlib import Path

import pytest
from replay_support import synthetic_lines, write_trace

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.replay.trace import REPLAY_MODEL, REPLAY_SALT, KeySpace, TraceError, read_trace


def test_reads_every_request_in_order(tmp_path: Path) -> None:
    lines = synthetic_lines(1, requests=50)
    trace = read_trace(write_trace(tmp_path / "t.jsonl", lines))
    assert len(trace.requests) == 50
    assert [list(r.hash_ids) for r in trace.requests] == [line["hash_ids"] for line in lines]
    assert trace.block_references == sum(len(line["hash_ids"]) for line in lines)  # type: ignore[arg-type]
    assert trace.chain_conflicts() == 0


def test_extra_fields_and_blank_lines_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = {"timestamp": 1.5, "input_length": 700, "output_length": 3, "hash_ids": [4, 5], "session": "x"}
    path.write_text("\n" + json.dumps(line) + "\n\n")
    (request,) = read_trace(path).requests
    assert request.hash_ids == (4, 5) and request.timestamp_ms == 1.5


def test_a_repeated_block_ends_the_prefix(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 1, 3]}],
    )
    assert read_trace(path).requests[0].hash_ids == (1, 2)


def test_prefix_tokens_count_a_partial_last_block() -> None:
    from lmcache_tiers.replay.trace import TraceRequest

    request = TraceRequest(0.0, 1200, 1, (1, 2, 3))
    assert [request.prefix_tokens(n) for n in range(4)] == [0, 512, 1024, 1200]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1}',
            "line 2: Object missing required field `hash_ids`",
        ),
        ("not json", "line 2: not a JSON object"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
            "line 2: Expected `int`",
        ),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}', "line 2: input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "line 2: hash id -1"),
        # timestamps no clock can wait for: refused here, not an OverflowError while pacing
        (
            '{"timestamp": 1e300, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            r"line 2: timestamp 1e\+300 is outside",
        ),
        (
            '{"timestamp": -1e300, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            r"line 2: timestamp -1e\+300 is outside",
        ),
        (
            '{"timestamp": 1' + "0" * 400 + ', "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "line 2: Number out of range",
        ),
        # a length no request has: it would silently drown every token hit rate
        (
            '{"timestamp": 0, "input_length": 1' + "0" * 400 + ', "output_length": 1, "hash_ids": [1]}',
            "line 2: input_length and output_length must not exceed",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 18446744073709551616, "hash_ids": [1]}',
            "line 2: input_length and output_length must not exceed",
        ),
        # an extra field nested past the decoder's recursion limit: one line, not a RecursionError
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "x": '
            + "[" * 100_000
            + "]" * 100_000
            + "}",
            "line 2: nested too deeply",
        ),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + content + "\n"
    )
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_negative_and_out_of_order_timestamps_are_read(tmp_path: Path) -> None:
    lines = [
        {"timestamp": stamp, "input_length": 5, "output_length": 1, "hash_ids": [index]}
        for index, stamp in enumerate([-5.0, -(2**53), 2**53, 0.0])
    ]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", lines))
    assert [request.timestamp_ms for request in trace.requests] == [-5.0, -(2**53), 2**53, 0.0]


def test_missing_empty_and_directory_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no requests"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
def test_a_read_error_names_the_file_and_line() -> None:
    # /proc/self/mem opens but fails to read (EIO), as a failing disk does
    with pytest.raises(TraceError, match="/proc/self/mem line 1: cannot read"):
        read_trace("/proc/self/mem")


def test_limit_reads_only_the_head(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", synthetic_lines(2, requests=40))
    assert len(read_trace(path, limit=10).requests) == 10


def test_chain_conflicts_are_found(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [3, 2]},
    ]
    assert read_trace(write_trace(tmp_path / "t.jsonl", lines)).chain_conflicts() == 1


def test_chain_conflicts_count_blocks_not_references(tmp_path: Path) -> None:
    # The report says "N blocks appear after two different parents": a block sent again
    # and again after its second parent is still one block.
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        *({"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [3, 2]} for _ in range(4)),
        {"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [4, 2]},
    ]
    assert read_trace(write_trace(tmp_path / "t.jsonl", lines)).chain_conflicts() == 1


def test_keys_are_replay_keys_named_by_block_id() -> None:
    space = KeySpace()
    key = space.key(258)
    assert key == ObjectKey(REPLAY_MODEL, 0, (258).to_bytes(8, "big"), 0, REPLAY_SALT)
    assert space.key(258) is key
    assert KeySpace.block_of(key) == 258


def test_unsafe_key_names_are_refused() -> None:
    from lmcache_tiers.errors import KeyValidationError

    with pytest.raises(KeyValidationError):
        KeySpace(model="a@b")


def test_a_limit_does_not_read_past_the_head(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", synthetic_lines(3, requests=4))
    with path.open("a") as handle:
        handle.write("not json\n")  # line 5: beyond --limit 4, so never an error
    assert len(read_trace(path, limit=4).requests) == 4
    with pytest.raises(TraceError, match="line 5"):
        read_trace(path, limit=5)


def test_reading_tells_a_progress_hook_every_byte(tmp_path: Path) -> None:
    """A trace of gigabytes took minutes to read with nothing on the screen."""
    from lmcache_tiers.replay.trace import PROGRESS_LINES

    path = write_trace(tmp_path / "t.jsonl", synthetic_lines(1, requests=2 * PROGRESS_LINES + 5))
    told: list[int] = []
    trace = read_trace(path, progress=told.append)
    assert len(trace.requests) == 2 * PROGRESS_LINES + 5
    assert sum(told) == path.stat().st_size
    assert len(told) == 3  # every PROGRESS_LINES lines, then the rest
