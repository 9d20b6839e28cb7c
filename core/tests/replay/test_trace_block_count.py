"""A trace line names one hash id per 512-token block of its prompt, never more."""

import json
from pathlib import Path

import pytest
from replay_support import run_replay, write_trace

from lmcache_tiers.replay.trace import TraceError, read_trace


def _line(input_length: int, hash_ids: list[int]) -> dict[str, object]:
    return {"timestamp": 0, "input_length": input_length, "output_length": 1, "hash_ids": hash_ids}


def test_more_hash_ids_than_the_prompt_has_blocks_is_refused(tmp_path: Path) -> None:
    # 1,000 tokens are two 512-token blocks; 63 ids are blocks of 16 tokens, another
    # format: replayed, two hits were shown as 1,000 of 1,000 tokens (100 %) for 2 of 63
    # blocks.
    path = write_trace(tmp_path / "t.jsonl", [_line(1024, [1, 2]), _line(1000, list(range(10, 73)))])
    with pytest.raises(TraceError, match=r"t\.jsonl line 2: 63 hash ids for 1000 input tokens, .* 2"):
        read_trace(path)


def test_hash_ids_for_an_empty_prompt_are_refused(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [_line(0, [1])])
    with pytest.raises(TraceError, match="line 1: 1 hash ids for 0 input tokens"):
        read_trace(path)


@pytest.mark.parametrize(
    ("input_length", "hash_ids"),
    [
        (1, [1]),  # a partial block is a block
        (512, [1]),
        (513, [1, 2]),
        (1024, [1]),  # fewer ids (only whole blocks hashed, or a cut prompt): the rest never hits
        (2048, [1, 2, 1, 3]),  # a repeat ends the prefix, after the count is checked
        (0, []),
    ],
)
def test_up_to_one_hash_id_per_block_is_read(tmp_path: Path, input_length: int, hash_ids: list[int]) -> None:
    path = write_trace(tmp_path / "t.jsonl", [_line(input_length, hash_ids)])
    (request,) = read_trace(path).requests
    assert list(request.hash_ids) == list(dict.fromkeys(hash_ids))[: len(request.hash_ids)]


def test_the_command_refuses_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_line(10, [1, 2, 3])) + "\n")
    code, out, err = run_replay(capsys, str(path), "--simulate", "--capacity", "4")
    assert code == 2
    assert out == ""
    assert err.strip().splitlines() == [
        f"error: {path} line 1: 3 hash ids for 10 input tokens, but a Mooncake trace has one id per "
        "512-token block of the prompt (at most 1 here)"
    ]
