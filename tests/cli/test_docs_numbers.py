"""The limits, defaults and timeouts README.md and docs/ quote are the code's.

Each claim below is the sentence a document gives, written from the constant or default it
states: a change of the constant changes the sentence, and the document that still quotes
the old number fails here until it says the new one.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_frontend_native import NativeConfig

from lmcache_tiers import defaults
from lmcache_tiers.cli import connect
from lmcache_tiers.cli.replay_cmd import MAX_CLIENTS
from lmcache_tiers.client import Client, spin
from lmcache_tiers.client import connection as client_connection
from lmcache_tiers.config import MAX_CONFIG_BYTES, MAX_GIB
from lmcache_tiers.l1.removal import REAP_BATCH
from lmcache_tiers.l2.adapter import DEFAULT_ASYNC_CONCURRENCY, BackendAdapter
from lmcache_tiers.l2.runners import Runner
from lmcache_tiers.l2.state import MAX_OBJECT_BYTES
from lmcache_tiers.replay.run import MAX_PACED_S
from lmcache_tiers.replay.trace import MAX_LINE_BYTES
from lmcache_tiers.router import RECEIVE_QUEUE_MESSAGES
from lmcache_tiers.server import stuck_stop
from lmcache_tiers.server.app import _JOIN_GRACE_S
from lmcache_tiers.server.preflight import SERVE_OPEN_FILES, UNIX_SOCKET_PATH_MAX
from lmcache_tiers.wire import protocol as wire_protocol
from lmcache_tiers.wire.decoding import KEY_CACHE_ENTRIES
from lmcache_tiers.wire.protocol import MAX_HEADER_BYTES

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
#: numbers the documents write in words
WORDS = {2.0: "two", 0.25: "a quarter"}


def _text(name: str) -> str:
    """The document with its line breaks and indents as single spaces, as prose wraps."""
    return " ".join((ROOT / name).read_text().split())


def _default(function: Callable[..., object], name: str) -> object:
    return inspect.signature(function).parameters[name].default


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}"


def _seconds(value: float) -> str:
    return f"{value:g}"


def _claims() -> list[tuple[str, str]]:
    eviction = defaults.DEFAULT_L2_EVICTION
    native = NativeConfig()
    shutdown_default = 10.0  # serve --shutdown-timeout, checked against --help below
    stop_bound = 2 * shutdown_default + _JOIN_GRACE_S + stuck_stop.GRACEFUL_CLOSE_WINDOW_S
    torch_pin = re.search(r"^torch==\S+", (ROOT / "constraints.txt").read_text(), re.M)
    assert torch_pin is not None
    return [
        ("README.md", f"`constraints.txt`, which pins `{torch_pin.group(0)}` (the CPU build)"),
        ("CONTRIBUTING.md", f"it pins `{torch_pin.group(0)}`, the CPU build"),
        (
            "README.md",
            f"capped at {defaults.DEFAULT_L2_CAPACITY_GB} GiB or "
            f"{_percent(defaults.DEFAULT_L2_DISK_FRACTION)} of its filesystem",
        ),
        (
            "README.md",
            f"with {eviction['eviction_policy']} eviction at {_percent(eviction['trigger_watermark'])} "
            f"freeing {_percent(eviction['eviction_ratio'])}",
        ),
        (
            "docs/server.md",
            f"`max_inline_bytes` ({native.max_inline_bytes // MIB} MiB), `max_request_bytes` "
            f"({native.max_request_bytes >> 30} GiB), `pool_workers` ({native.pool_workers}) and "
            f"`max_keys_per_request` ({native.max_keys_per_request})",
        ),
        ("docs/server.md", f"`max_inline_bytes` + the {MAX_HEADER_BYTES // MIB} MiB header"),
        ("docs/server.md", f"Limits: {wire_protocol.MAX_KEYS_PER_REQUEST} keys per request"),
        ("docs/server.md", f"a {MAX_HEADER_BYTES // MIB} MiB header (a header over it is refused"),
        ("docs/server.md", f"an auth token of at most {wire_protocol.MAX_TOKEN_LEN} characters"),
        ("docs/server.md", f"LOOKUP's `wait_s` (default 0, at most {wire_protocol.MAX_WAIT_S:g};"),
        ("docs/server.md", f"libzmq queues at most {RECEIVE_QUEUE_MESSAGES} complete messages"),
        ("docs/server.md", f"Below {SERVE_OPEN_FILES} no configuration can serve"),
        ("docs/server.md", f"serve needs at least {SERVE_OPEN_FILES} open files to start"),
        ("docs/server.md", f"Start-up refuses a limit below {SERVE_OPEN_FILES}"),
        ("docs/server.md", f"a path over the {UNIX_SOCKET_PATH_MAX}-byte limit of a Unix socket address"),
        ("docs/server.md", f"unreadable, over {MAX_CONFIG_BYTES // MIB} MiB or not UTF-8 TOML"),
        ("docs/server.md", f"`*_gb` sizes at most 2^{int(MAX_GIB).bit_length() - 1}"),
        ("docs/server.md", f"{REAP_BATCH} of them at most (`REAP_BATCH`)"),
        ("docs/server.md", f"the native key cache ({KEY_CACHE_ENTRIES} keys"),
        ("docs/server.md", f"After about {WORDS[connect.NOTICE_AFTER_S]} seconds without an answer"),
        ("docs/server.md", f"again every {connect.NOTICE_EVERY_S:g} s at most"),
        (
            "docs/server.md",
            f"`Client(url, timeout={_default(Client, 'timeout')})` (the default) bounds every call",
        ),
        ("docs/server.md", f"`Client(url, reply_spin_s={_default(Client, 'reply_spin_s')})` (the default)"),
        ("docs/server.md", f"(0 turns that off; at most {spin.MAX_REPLY_SPIN_S})"),
        ("docs/server.md", f"`Client(..., cleanup_timeout={_default(Client, 'cleanup_timeout')})`"),
        (
            "docs/server.md",
            f"answered no heartbeat for {client_connection.HEARTBEAT_TIMEOUT_MS // 1000} s (the client "
            f"sends one every {client_connection.HEARTBEAT_INTERVAL_MS // 1000} s",
        ),
        ("docs/server.md", f"it fails within {WORDS[client_connection.LINK_CHECK_S]} of a second"),
        (
            "docs/server.md",
            f"{_seconds(stuck_stop.FORCED_STOP_WINDOW_S)} s after the signal that forced it",
        ),
        (
            "docs/server.md",
            f"{_seconds(_JOIN_GRACE_S)} s for the front ends to finish their drain, and "
            f"{_seconds(stuck_stop.GRACEFUL_CLOSE_WINDOW_S)} s for the close -- "
            f"{_seconds(stop_bound)} s after the signal by default",
        ),
        (
            "docs/server.md",
            f"`close_backend_timeout_s` ({_seconds(BackendAdapter.close_backend_timeout_s)} s;",
        ),
        ("docs/replay.md", f"a line longer than {MAX_LINE_BYTES // MIB} MiB"),
        ("docs/replay.md", f"a schedule longer than {MAX_PACED_S / 86400:g} days"),
        ("docs/replay.md", f"`--clients N` takes at most {MAX_CLIENTS} processes"),
        ("docs/plugin-guide.md", f"at most `concurrency` ({DEFAULT_ASYNC_CONCURRENCY}) at once"),
        (
            "docs/plugin-guide.md",
            f"within {_seconds(Runner.listing_stall_timeout_s)} s (`Runner.listing_stall_timeout_s`)",
        ),
        ("docs/plugin-guide.md", f"one past any object's, {MAX_OBJECT_BYTES >> 40} TiB,"),
    ]


@pytest.mark.parametrize(("document", "claim"), _claims())
def test_the_document_quotes_the_code(document: str, claim: str) -> None:
    assert claim in _text(document), f"{document} no longer says: {claim}"


def test_the_shutdown_timeout_the_claims_assume_is_serves_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_tiers.cli.main import main

    monkeypatch.setenv("COLUMNS", "300")
    main(["serve", "--print-config"])
    assert re.search(r'"shutdown_timeout_s": 10\.0\b', capsys.readouterr().out)


def test_a_changed_constant_is_a_claim_no_document_makes() -> None:
    text = _text("docs/server.md")
    assert f"libzmq queues at most {RECEIVE_QUEUE_MESSAGES} complete messages" in text
    assert f"libzmq queues at most {RECEIVE_QUEUE_MESSAGES + 1} complete messages" not in text


#: "10 s (`LISTING_DEADLINE_S`)" and "`JOIN_GRACE_S` (10 s)": a number a document gives
#: beside the name of the constant that holds it
_NUMBER = r"(\d[\d,]*(?:\.\d+)?)\s*(s|ms|KiB|MiB|GiB|TiB|%)?"
NUMBER_THEN_NAME = re.compile(_NUMBER + r"\s*\(`([A-Z][A-Z0-9_]{2,})`")
NAME_THEN_NUMBER = re.compile(r"`([A-Z][A-Z0-9_]{2,})`\s*\(" + _NUMBER + r"[);,]")
UNITS = {
    "": 1.0,
    "s": 1.0,
    "ms": 1e-3,
    "KiB": 2.0**10,
    "MiB": 2.0**20,
    "GiB": 2.0**30,
    "TiB": 2.0**40,
    "%": 0.01,
}
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.LShift: operator.lshift,
    ast.Pow: operator.pow,
}


def _value(node: ast.expr) -> int | float | None:
    """The number a constant's definition computes from literals alone, else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        number: int | float = node.value  # type: ignore[assignment]
        return number
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if left is not None and right is not None:
            try:
                result: int | float = _OPERATORS[type(node.op)](left, right)
            except TypeError:  # a shift of a float
                return None
            return result
    return None


def constant_values(sources: list[Path]) -> dict[str, set[float]]:
    values: dict[str, set[float]] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(node, ast.AnnAssign):
                target = node.target
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and target.id.isupper() and isinstance(value, ast.expr):
                number = _value(value)
                if number is not None:
                    values.setdefault(target.id, set()).add(float(number))
    return values


def numbers_beside_names(text: str) -> list[tuple[str, float, str]]:
    """(constant, the value the text gives it, the words) for each such pair in ``text``."""
    flat = " ".join(text.split())
    pairs = [(m.group(3), m.group(1), m.group(2), m.group(0)) for m in NUMBER_THEN_NAME.finditer(flat)]
    pairs += [(m.group(1), m.group(2), m.group(3), m.group(0)) for m in NAME_THEN_NUMBER.finditer(flat)]
    return [
        (name, float(number.replace(",", "")) * UNITS[unit or ""], words)
        for name, number, unit, words in pairs
    ]


def _wrong_numbers(text: str, values: dict[str, set[float]]) -> list[str]:
    return [
        f"{words}: the code has {sorted(values[name])}"
        for name, given, words in numbers_beside_names(text)
        if name in values and not any(math.isclose(given, value) for value in values[name])
    ]


def test_a_number_beside_a_constants_name_is_its_value() -> None:
    values = constant_values(
        [*(ROOT / "core" / "src").rglob("*.py"), *(ROOT / "plugins").glob("*/src/**/*.py")]
    )
    wrong = []
    checked = 0
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        checked += sum(name in values for name, _, _ in numbers_beside_names(document.read_text()))
        wrong += [
            f"{document.relative_to(ROOT)}: {line}" for line in _wrong_numbers(document.read_text(), values)
        ]
    assert wrong == []
    assert checked >= 6


def test_the_number_check_catches_a_stale_value() -> None:
    values = {"DELETE_DEADLINE_S": {30.0}, "MAX_OBJECT_BYTES": {2.0**48}, "LIMIT": {65536.0}}
    text = "waits up to 20 s (`DELETE_DEADLINE_S`), `MAX_OBJECT_BYTES` (256 TiB), up to 65,536 (`LIMIT`)"
    assert _wrong_numbers(text, values) == ["20 s (`DELETE_DEADLINE_S`: the code has [30.0]"]
