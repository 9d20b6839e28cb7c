"""A client hammering requests the front end refuses (an unknown operation, arguments that
do not decode, an oversized argument, a message without an operation) costs counters, not
log volume: at most LOG_LINES_PER_WINDOW lines a window of LOG_WINDOW_S, and every refusal
counted."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import msgspec
import pytest
from lmcache_plugin_lmcache_mp.loop import LOG_LINES_PER_WINDOW, LOG_WINDOW_S
from lmcache_plugin_lmcache_mp.wire import MAX_ARGUMENT_BYTES, OPERATION_IDS
from mpclient import Key, MPClient, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

ROUNDS = 500
ENCODE = msgspec.msgpack.encode


def refused_messages(uid: int) -> list[list[bytes]]:
    lookup = ENCODE(OPERATION_IDS["lookup"])
    return [
        [ENCODE(uid), ENCODE(987_654)],  # an unknown operation
        [ENCODE(uid), lookup, b"\xc1", ENCODE(1)],  # 0xc1 is never valid msgpack
        [ENCODE(uid)],  # no operation frame
    ]


def test_hammered_refusals_are_logged_at_a_bounded_rate_and_all_counted(
    mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sent = 0
    began = time.monotonic()
    with MPClient(mp_address(mp_server)) as client:
        for uid in range(ROUNDS):
            for frames in refused_messages(uid):
                client.socket.send_multipart(frames)
                sent += 1
        # an oversized argument (64 MiB: sent once, as the others cost nothing to repeat)
        client.socket.send_multipart(
            [ENCODE(0), ENCODE(OPERATION_IDS["lookup"]), bytes(MAX_ARGUMENT_BYTES + 1), ENCODE(1)]
        )
        sent += 1
        assert client.call("noop") == "OK"  # handled in order: every refusal is in by now
    elapsed = time.monotonic() - began
    failures = mp_server.frontends[0].stats().failures
    assert failures["mp_unknown_op"] + failures["mp_bad_request"] == sent, failures
    lines = len(front_end_lines(caplog.records))
    assert lines, "the refusals were not explained in the log at all"
    # The budget's windows start LOG_WINDOW_S or more apart, each at a refusal of the run: a
    # run of ``elapsed`` seconds holds at most floor(elapsed / LOG_WINDOW_S) + 1 of them,
    # whatever the machine's speed.
    windows = math.floor(elapsed / LOG_WINDOW_S) + 1
    assert lines <= LOG_LINES_PER_WINDOW * windows, f"{lines} lines in {elapsed:.1f} s"


def front_end_lines(records: list[Any]) -> list[logging.LogRecord]:
    return [record for record in records if record.name.startswith("lmcache_plugin_lmcache_mp")]


def test_refused_requests_are_decoded_for_their_request_id_only_when_logged(
    mp_server: TiersServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key can be 64 MiB: decoding it for the request id of a line the budget holds back
    would cost the loop thread the decode of every refused request, logged or not."""
    from lmcache_plugin_lmcache_mp import loop

    decoded: list[str] = []
    real = loop._request_id

    def counting(name: str, arg_frames: list[bytes]) -> str:
        decoded.append(name)
        return real(name, arg_frames)

    monkeypatch.setattr(loop, "_request_id", counting)
    key = ENCODE(Key(tokens_of(1, 512), "driven", worker_id=0).encode())
    caplog.set_level(logging.WARNING)
    with MPClient(mp_address(mp_server)) as client:
        for uid in range(ROUNDS):  # LMCache-driven stores, which this front end does not serve
            client.socket.send_multipart([ENCODE(uid), ENCODE("store"), key, ENCODE(1), ENCODE([[1]]), b""])
        assert client.call("noop") == "OK"
    assert mp_server.frontends[0].stats().failures["mp_not_served"] == ROUNDS
    lines = [r for r in front_end_lines(caplog.records) if "mp_not_served" in r.getMessage()]
    assert lines and all("request_id driven" in r.getMessage() for r in lines)
    assert len(decoded) == len(lines) < ROUNDS
