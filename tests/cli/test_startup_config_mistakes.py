"""Mistakes in the configuration itself, which ``serve --print-config`` finds as ``serve``
does: one line naming the flag or config path, exit 2, on a narrow terminal too, and found
before the L1 segment exists.  Where the server keeps data and listens is checked in
``test_startup_errors.py``, the room L1 needs and the process's limits in
``test_startup_limits.py``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from startup_refusals import print_config
from thirdparty import free_port


def test_print_config_run_in_this_process_leaves_no_log_level_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    # serve sets LMCACHE_LOG_LEVEL for its process; run in the test process it must not
    # reach the tests after this one (nor the servers they start).
    monkeypatch.delenv("LMCACHE_LOG_LEVEL", raising=False)  # the runner's own comes back after
    levels = _logger_levels()
    with pytest.MonkeyPatch.context() as case:
        printed = print_config(["--no-default-l2"], case)
    assert printed.returncode == 0, printed.stderr
    assert "LMCACHE_LOG_LEVEL" not in os.environ, "print-config left the log level set"
    # nor the levels serve's logging set-up gives core's and the plugins' loggers
    assert _logger_levels() == levels


def _logger_levels() -> dict[str, int]:
    loggers = logging.root.manager.loggerDict.items()
    return {name: found.level for name, found in loggers if isinstance(found, logging.Logger) and found.level}


def _config_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(serve arguments, the start of its one error line): mistakes in the configuration
    itself, which ``--print-config`` finds as ``serve`` does."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('host = "caf\u00e9"\n'.encode("latin-1"))
    inner_typo = {"type": "fault_inject", "inner": {"type": "nosuch"}}
    deep: list[object] = []
    for _ in range(600):
        deep = [deep]
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("host = " + "[" * 20_000 + "]" * 20_000 + "\n")
    return [
        (
            ["--l1-size-gb", "inf"],
            "error: --l1-size-gb: Expected a finite number, got inf - at `$.l1_size_gb`",
        ),
        (["--l1-size-gb", "1e308"], "error: --l1-size-gb: Expected `float` <= 1073741824.0"),
        (
            ["--l2-adapter", '{"type": "fs", "path": "/tmp/x", "max_capacity_gb": 1e400}'],
            "error: fs: Expected a finite number, got inf - at `$.l2_adapters[0].max_capacity_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "mock", "max_size_gb": 1e400}'],
            "error: mock: Expected a finite number, got inf - at `$.l2_adapters[0].max_size_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "mock", "max_size_gb": 1e300}'],
            "error: mock: Expected `float` <= 1073741824.0 - at `$.l2_adapters[0].max_size_gb`",
        ),
        (
            ["--l2-adapter", '{"type": "redis", "url": "redis://:secret@h:99999/0"}'],
            "error: redis: the url's port must be a number from 1 to 65535 - at `$.l2_adapters[0].url`",
        ),
        (["--l2-adapter", json.dumps(inner_typo)], "error: unknown l2 adapter 'nosuch'"),
        (
            [
                "--l2-adapter",
                json.dumps({"type": "fault_inject", "inner": {"type": "mock", "max_size_gb": -1}}),
            ],
            "error: mock: Expected `float` > 0.0 - at `$.l2_adapters[0].inner.max_size_gb`",
        ),
        (["--shm-name", "a/b"], "error: --shm-name: shared-memory name 'a/b' is not allowed"),
        (["--l1-size-gb", "1e-9"], "error: --l1-size-gb 1e-09: smaller than one L1 extent of 4096 bytes"),
        (["--shm-dir", "relative"], "error: --shm-dir relative: give an absolute path"),
        (["--config", str(tmp_path)], f"error: config file '{tmp_path}' is a directory"),
        (["--config", str(latin1)], f"error: config file '{latin1}' is not valid TOML: it is not UTF-8 text"),
        # a device is no config file (and reading this one would never end)
        (
            ["--config", "/dev/zero"],
            "error: config file '/dev/zero' is a character device, not a file",
        ),
        (
            ["--shutdown-timeout", "-1"],
            "error: --shutdown-timeout: Expected `float` >= 0.0 - at `$.shutdown_timeout_s`",
        ),
        # a field taking any data, nested deep enough to exhaust the stack of what walks it
        (
            [
                "--l2-adapter",
                json.dumps({"type": "fs", "path": "memory://x", "storage_options": {"a": deep}}),
            ],
            "error: fs: Expected lists and tables nested at most 32 levels deep - at "
            "`$.l2_adapters[0].storage_options.a[0]",
        ),
        # nested past the parsers' own recursion limits
        (["--config", str(deep_toml)], f"error: config file '{deep_toml}' is not valid TOML: its values are"),
        (
            ["--l2-adapter", '{"type": "mock", "x": ' + "[" * 20_000 + "]" * 20_000 + "}"],
            "error: --l2-adapter #1 is not valid config JSON: it is nested too deeply",
        ),
    ]


@pytest.mark.parametrize("case", range(18))
def test_configuration_mistakes_are_found_by_print_config_as_by_serve(
    case: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked_cli: ForkedCli
) -> None:
    args, start = _config_cases(tmp_path)[case]
    line = forked_cli.serve_refused(["--no-default-l2", "--port", str(free_port()), *args])
    assert line.startswith(start), line
    assert "secret" not in line
    printed = print_config(["--no-default-l2", *args], monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == line


def test_the_inner_spec_of_a_wrapper_is_named_by_its_path(forked_cli: ForkedCli) -> None:
    wrapped = {"type": "fault_inject", "inner": {"type": "nosuch"}}
    line = forked_cli.serve_refused(["--no-default-l2", "--l2-adapter", json.dumps(wrapped)])
    assert line.endswith("- at `$.l2_adapters[0].inner.type`"), line
    assert "installed: " in line and "fault_inject `inner`" not in line, line


def test_dashed_l2_adapters_in_a_config_file_are_not_replaced_by_the_default_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forked_cli: ForkedCli
) -> None:
    config = tmp_path / "tiers.toml"
    config.write_text('[[l2-adapters]]\ntype = "mock"\nmax_size_gb = 0.5\n\n[[frontends]]\ntype = "native"\n')
    printed = print_config(["--config", str(config)], monkeypatch)
    assert printed.returncode == 0, printed.stderr
    resolved = json.loads(printed.stdout)
    assert [(a["type"], a["max_size_gb"]) for a in resolved["l2_adapters"]] == [("mock", 0.5)]
    assert [f["type"] for f in resolved["frontends"]] == ["native"]
    config.write_text('[[l2-adapters]]\ntype = "mock"\n\n[[l2_adapters]]\ntype = "mock"\n')
    line = forked_cli.serve_refused(["--config", str(config)])
    assert line == (
        f"error: --config {config}: config field `$.l2_adapters` is given twice "
        "(as `l2-adapters` and `l2_adapters`)"
    )
    config.write_text("l1_size_gbb = 1\n")
    assert (
        forked_cli.serve_refused(["--config", str(config)])
        == f"error: --config {config}: unknown config field `$.l1_size_gbb`"
    )


def test_a_shutdown_timeout_no_stop_can_wait_is_refused_before_start(forked_cli: ForkedCli) -> None:
    # A deadline beyond what a thread join takes made the stop itself fail (OverflowError
    # joining the front ends): a traceback and exit 1 on SIGTERM instead of a drain.
    line = forked_cli.serve_refused(
        ["--no-default-l2", "--port", str(free_port()), "--shutdown-timeout", "1e300"]
    )
    assert line == "error: --shutdown-timeout: Expected `float` <= 86400.0 - at `$.shutdown_timeout_s`"


def test_an_empty_config_path_is_refused_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    # `--config "$TIERS_CONFIG"` with the variable unset must not serve the defaults.
    printed = print_config(["--no-default-l2", "--config", ""], monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == "error: config file '' does not exist"


def test_a_non_utf8_auth_token_is_refused_before_start(
    monkeypatch: pytest.MonkeyPatch, forked_cli: ForkedCli
) -> None:
    # A byte that is not UTF-8 in a flag reaches Python as a lone surrogate: --print-config
    # showed it, and serve built L1 and the front ends before encoding the token failed
    # ("cannot start the server: UnicodeEncodeError ...", exit 1).
    args = ["--no-default-l2", "--port", str(free_port()), "--auth-token", "\udcff"]
    line = forked_cli.serve_refused(args)
    refusal = "Expected UTF-8 text, got a lone surrogate \\udcff - at `$.auth_token`"
    assert line == f"error: --auth-token: {refusal}"
    # in this process the flag is the str Python decodes the byte to, as in the console script
    printed = print_config(args, monkeypatch)
    assert printed.returncode == 2 and printed.stdout == "", printed.stdout
    assert printed.stderr.strip() == line
