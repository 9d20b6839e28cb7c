"""Bad values for every field of every installed component and of the server, through the
real command line (``serve --print-config``, ``status``, ``bench``, ``replay``): each is
either taken (the printed config is JSON) or refused with exit code 2 and one line on
stderr naming the field -- never a traceback, never a marker secret in any output.

The command is built once and run in this process on every input (as the console script
runs it), so the hundreds of inputs take seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmcache_tiers.cli.main import build_app, command_tree, run
from lmcache_tiers.config import SECRET_FIELD, ServerConfig
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.wire.protocol import MAX_TOKEN_LEN

SECRET = "S3CR3T-fuzz-marker-7731"
#: the longest line an error may be: journald splits longer ones, losing the field's path
MAX_LINE = 4096
#: one of each kind of wrong value: a nested object, a number past 64 bits, a number past
#: every range, and text that is no UTF-8 (a JSON "\\ud800")
BAD_VALUES: list[Any] = [{"nested": [1]}, 2**70, 1e308, "\ud800"]
LONG = "x" * (1 << 20)

COMMAND = command_tree(build_app())
REGISTRY = load_registry()


def cli(argv: list[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``lmcache-tiers ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run(lambda: COMMAND, argv)
        except SystemExit as exc:
            code = exc.code
    return (code if isinstance(code, int) else 0 if code is None else 1), out.getvalue(), err.getvalue()


def assert_taken_or_refused(argv: list[str], field: str, *others: str) -> None:
    """Taken: exit 0 and the config as JSON.  Refused: exit 2 and one short line naming
    ``field`` (or one of the ``others`` it may conflict with).  Never a traceback nor the
    marker secret."""
    code, out, err = cli(argv)
    shown = f"{argv[:4]!r:.300}: exit {code}, stderr {err[:400]!r}"
    assert "Traceback" not in out + err, shown
    assert SECRET not in out + err, shown
    if code == 0:
        json.loads(out)
        return
    assert code == 2, shown
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert len(lines[0]) <= MAX_LINE, f"{shown}: a line of {len(lines[0])} characters"
    assert any(name in lines[0] for name in (field, *others)), shown


def _components() -> Iterator[tuple[Kind, str, type[msgspec.Struct]]]:
    for kind in (Kind.L2_ADAPTER, Kind.FRONTEND, Kind.SERDE):
        for name in REGISTRY.names(kind):
            yield kind, name, REGISTRY.get(kind, name).config


#: the fields a component cannot do without, set to usable values
REQUIRED: dict[str, dict[str, Any]] = {
    "dax": {"slot_bytes": 1 << 20, "device_path": "/dev/dax0.0", "max_dax_size_gb": 1},
    "fault_inject": {"inner": {"type": "mock"}},
    "fs": {"path": "/tmp/lmcache-tiers-fuzz-fs"},
    "nixl_store": {"backend": "POSIX", "pool_size": 4, "backend_params": {"file_path": "/tmp/x"}},
    "nixl_store_dynamic": {"backend": "POSIX", "backend_params": {"file_path": "/tmp/x"}},
    "raw_block": {"device_path": "/tmp/lmcache-tiers-fuzz-block", "slot_bytes": 1 << 20},
    "redis": {"url": "redis://127.0.0.1:1"},
    "resp": {"url": "redis://127.0.0.1:1"},
    "valkey": {"url": "redis://127.0.0.1:1"},
    "s3": {"bucket": "fuzz"},
}


def _argv(kind: Kind, name: str, field: str, value: Any) -> list[str]:
    spec = {"type": name, **REQUIRED.get(name, {}), field: value}
    if kind is Kind.FRONTEND:
        return ["serve", "--print-config", "--no-default-l2", "--frontend", json.dumps(spec)]
    if kind is Kind.SERDE:
        spec = {"type": "mock", "serde": [spec]}
    return ["serve", "--print-config", "--l2-adapter", json.dumps(spec)]


def _values_for(field: str) -> list[Any]:
    if SECRET_FIELD.search(field):
        # a credential of the wrong type or shape must not be quoted back either
        return [*BAD_VALUES, SECRET, [SECRET], {"k": SECRET}, f"{SECRET}\0", f"redis://u:{SECRET}@h:1"]
    return BAD_VALUES


@pytest.mark.parametrize(("kind", "name", "config"), list(_components()), ids=lambda v: str(v))
def test_every_field_of_every_component_takes_or_refuses_bad_values(
    kind: Kind, name: str, config: type[msgspec.Struct]
) -> None:
    fields = [info.encode_name for info in msgspec.structs.fields(config)]
    for field in fields:
        for value in _values_for(field):
            assert_taken_or_refused(_argv(kind, name, field, value), field, *REQUIRED.get(name, {}))
    # an unknown field, a key written twice, a 1 MiB field name
    assert_taken_or_refused(_argv(kind, name, "no_such_field", 1), "no_such_field")
    first = _argv(kind, name, "type", name)
    assert_taken_or_refused([*first[:-1], first[-1].replace("{", '{"type": "x", ', 1)], "`type`")
    code, _, err = cli(_argv(kind, name, LONG, 1))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[:300]
    assert len(err.strip()) <= MAX_LINE, f"a line of {len(err.strip())} characters"


#: TOML spellings of wrong values of a server field
TOML_VALUES = ["{a = 1}", str(2**70), "nan", "-inf", '"\\u0000"', "1979-05-27T07:32:00Z", f'"{SECRET}"']


@pytest.mark.parametrize("field", [info.encode_name for info in msgspec.structs.fields(ServerConfig)])
def test_every_server_field_in_a_config_file_takes_or_refuses_bad_values(tmp_path: Path, field: str) -> None:
    path = tmp_path / "c.toml"
    for value in TOML_VALUES:
        if value == f'"{SECRET}"' and not SECRET_FIELD.search(field):
            continue  # a host or path is no secret: it may be quoted
        path.write_text(f"{field} = {value}\n", encoding="utf-8")
        assert_taken_or_refused(["serve", "--print-config", "--no-default-l2", "--config", str(path)], field)


@pytest.mark.parametrize(
    "text",
    [
        "port = 1\nport = 2\n",
        "no_such_key = 1\n",
        "l2_adapters = 5\n",
        "l2_adapters = [5]\n",
        "[[frontends]]\n",
    ],
)
def test_a_malformed_config_file_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    assert_taken_or_refused(["serve", "--print-config", "--no-default-l2", "--config", str(path)], "")


@pytest.mark.parametrize(
    "flag",
    ["--l1-size-gb", "--l1-align-bytes", "--shm-name", "--eviction-policy", "--eviction-ratio", "--port",
     "--chunk-size", "--shutdown-timeout", "--host", "--metrics-port", "--l2-store-policy", "--config"],
)  # fmt: skip
def test_a_huge_flag_value_is_refused_on_one_short_line(flag: str) -> None:
    for value in (LONG, str(2**70), "nan", "-inf"):
        assert_taken_or_refused(["serve", "--print-config", "--no-default-l2", flag, value], "")


def _token_cases() -> list[str]:
    # "\udcff": what a byte of a command line that is no UTF-8 arrives as
    return [f"{SECRET}\udcff", SECRET + "x" * MAX_TOKEN_LEN]


@pytest.mark.parametrize("command", ["status", "bench"])
@pytest.mark.parametrize("token", _token_cases(), ids=["not-utf8", "too-long"])
def test_a_client_token_no_server_can_take_is_a_usage_error(command: str, token: str) -> None:
    code, out, err = cli([command, "--timeout", "0.05", "--url", "tcp://127.0.0.1:1", "--auth-token", token])
    assert code == 2, err
    assert "Traceback" not in err and SECRET not in out + err, err
    assert len(err.strip().splitlines()) == 1 and "--auth-token" in err, err


@pytest.mark.parametrize("token", _token_cases(), ids=["not-utf8", "too-long"])
def test_a_replay_token_no_server_can_take_is_a_usage_error(tmp_path: Path, token: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["replay", "--url", "tcp://127.0.0.1:1", "--timeout", "0.05", "--auth-token", token, str(trace)]
    code, out, err = cli(argv)
    assert code == 2, err
    assert "Traceback" not in err and SECRET not in out + err, err
    assert len(err.strip().splitlines()) == 1 and "--auth-token" in err, err
