"""LMCache server flags: aliases set the right field, the rest are refused in one line.

The table in docs/lmcache-compat.md is checked against the code, and against the
reference's own ``lmcache server --help`` when LMCache is installed here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from thirdparty import run_cli, run_cli_in_process

from lmcache_tiers.cli import lmcache_flags
from lmcache_tiers.cli.main import build_app, command_tree, main

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "docs" / "lmcache-compat.md"
#: the reference venv scripts/install_reference_lmcache.sh fills (LMCACHE_REF_VENV moves it)
_CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
_REF_VENV = Path(os.environ.get("LMCACHE_REF_VENV", _CACHE_HOME / "lmcache-tiers" / "lmcache-0.5.6"))
REFERENCE_LMCACHE = Path(os.environ.get("LMCACHE_REFERENCE_BIN", _REF_VENV / "bin" / "lmcache"))


def print_config(*flags: str) -> dict[str, object]:
    result = run_cli_in_process(["serve", "--print-config", "--no-default-l2", *flags])
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the CLI in this process for a command line refused while parsing."""
    with pytest.raises(SystemExit) as stopped:
        main(list(args))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_aliases_set_the_fields_they_name() -> None:
    config = print_config(
        "--l1-read-ttl-seconds",
        "12.5",
        "--l1-write-ttl-seconds",
        "30",
        "--l1-align-bytes",
        "8192",
        "--shm-name",
        "tiers_alias_check",
        "--http-host",
        "127.0.0.2",
        "--http-port",
        "9555",
    )
    assert config["l1_lock_ttl_s"] == 12.5
    assert config["l1_write_ttl_s"] == 30.0
    assert config["l1_align_bytes"] == 8192
    assert config["l1_shm_name"] == "tiers_alias_check" and config["no_shm"] is False
    assert config["metrics_host"] == "127.0.0.2"
    assert config["metrics_port"] == 9555
    assert print_config("--prometheus-port", "9666")["metrics_port"] == 9666
    assert print_config("--metrics-port", "9667", "--prometheus-port", "9667")["metrics_port"] == 9667
    assert print_config("--metrics-host", "127.0.0.3")["metrics_host"] == "127.0.0.3"
    assert print_config("--disable-metrics")["metrics_port"] == 0
    assert print_config("--shm-name", "")["no_shm"] is True


def test_flags_override_the_config_file_even_at_their_default(tmp_path: Path) -> None:
    config_file = tmp_path / "tiers.toml"
    config_file.write_text("l1_lock_ttl_s = 60.0\nport = 6000\nshutdown_timeout_s = 30.0\n")
    config = print_config(
        "--config",
        str(config_file),
        "--l1-read-ttl-seconds",
        "300",
        "--port",
        "6001",
        "--shutdown-timeout",
        "2.5",
    )
    assert config["l1_lock_ttl_s"] == 300.0 and config["port"] == 6001 and config["shutdown_timeout_s"] == 2.5
    from_file = print_config("--config", str(config_file))
    assert from_file["l1_lock_ttl_s"] == 60.0 and from_file["shutdown_timeout_s"] == 30.0


def test_accepted_no_op_flags_say_so_in_a_log_line() -> None:
    result = run_cli(
        [
            "serve",
            "--print-config",
            "--no-default-l2",
            "--l1-init-size-gb",
            "20",
            "--transport",
            "zmq",
            "--hash-algorithm",
            "blake3",
            "--engine-type",
            "default",
            "--supported-transfer-mode",
            "auto",
            "--gds-l1-backend",
            "auto",
            "--no-l1-use-hugepages",
            "--no-run-script-api-enabled",
            "--no-separate-object-groups",
            "--isolated-ipc",
        ]
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert all(re.match(r"^\d{4}-\d\d-\d\d .* INFO lmcache_tiers\.cli\.serve: ", line) for line in lines)
    assert "--l1-init-size-gb/--l1-use-lazy: L1 is allocated and pre-faulted whole at start-up" in lines[0]
    assert "--isolated-ipc" in lines[1] and "--supported-transfer-mode auto" in lines[2]
    assert '"allow_pickle": true' in lines[1], "LMCache's clients send pickled chunks then"
    assert json.loads(result.stdout)["l1_size_gb"] == 1.0


@pytest.mark.parametrize("flag", sorted(lmcache_flags.REFUSED))
def test_flags_of_missing_features_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    line = usage_error(capsys, "serve", flag, "1")
    assert line.startswith(f"error: {flag} (an LMCache server flag) is not supported: ")
    assert line.endswith("remove it (docs/lmcache-compat.md)")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--session-ttl-seconds", "session_ttl_s"),
        ("--worker-reap-timeout-seconds", "worker_reap_timeout_s"),
        ("--worker-registration-grace-seconds", "worker_registration_grace_s"),
    ],
)
def test_session_flags_point_to_the_option_of_the_lmcache_mp_front_end(
    capsys: pytest.CaptureFixture[str], flag: str, field: str
) -> None:
    line = usage_error(capsys, "serve", flag, "30")
    spec = f'{{"type": "lmcache_mp", "{field}": SECONDS}}'
    assert f"for LMCache's clients it is an option of the lmcache_mp front end: --frontend '{spec}'" in line
    # the option it names is one the front end takes
    filled = print_config("--frontend", spec.replace("SECONDS", "30"))
    assert filled["frontends"][0][field] == 30  # type: ignore[index]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--transport", "grpc"),
            "Invalid value for '--transport': 'grpc' is not available: there is no gRPC",
        ),
        (("--hash-algorithm", "sha256_cbor"), "chunk keys are chained blake3 hashes"),
        (("--engine-type", "blend"), "CacheBlend is not part of lmcache-tiers"),
        (("--supported-transfer-mode", "lmcache_driven"), "the server never copies from engine memory"),
        (("--gds-l1-backend", "cufile"), "there is no GPUDirect backend to choose"),
        (("--l1-use-hugepages",), "L1 is not allocated from the hugepage pool"),
        (("--run-script-api-enabled",), "there is no /run_script endpoint"),
        (("--separate-object-groups",), "object groups come from each key's object_group"),
    ],
)
def test_values_lmcache_tiers_cannot_honour_are_refused(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    assert message in usage_error(capsys, "serve", *args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--prometheus-port", "9091", "--http-port", "8080"), "--prometheus-port 9091 and --metrics-port"),
        (("--disable-metrics", "--metrics-port", "8080"), "--disable-metrics turns the HTTP endpoint off"),
        (("--shm-name", "abc", "--no-shm"), "--shm-name 'abc' names a segment, but --no-shm turns it off"),
    ],
)
def test_contradicting_flags_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    result = run_cli_in_process(["serve", "--print-config", *args])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def _compat_table() -> dict[str, str]:
    """docs/lmcache-compat.md: flag -> its lmcache-tiers column."""
    rows = re.findall(r"^\| `(-{1,2}[\w-]+)` \| ([^|]+) \|", COMPAT.read_text(), flags=re.MULTILINE)
    table = dict((flag, status.strip()) for flag, status in rows)
    assert len(table) == len(rows), "a flag is listed twice"
    return table


def _serve_option_names() -> set[str]:
    serve = command_tree(build_app()).commands["serve"]
    names = {"-h", "--help"}
    for param in serve.params:
        names.update(param.opts)
        names.update(param.secondary_opts)
    return names


def test_compat_table_matches_the_code() -> None:
    table = _compat_table()
    options = _serve_option_names()
    for flag, status in table.items():
        if status == "refused":
            assert flag in lmcache_flags.REFUSED, flag
        elif status.startswith("accepted: "):
            values = re.findall(r"`([^`]+)`", status)
            if flag in lmcache_flags.VALUE_CHECKED:
                assert tuple(values) == lmcache_flags.VALUE_CHECKED[flag][0], flag
            else:
                assert flag in lmcache_flags.SWITCHES_REFUSED_ON and values == [f"--no-{flag[2:]}"], flag
        else:
            assert status in ("same", "alias", "accepted"), (flag, status)
            assert flag in options, flag
    refused = {flag for flag in lmcache_flags.REFUSED if flag != "--quiet"}  # "-q" row covers it
    assert refused == {flag for flag, status in table.items() if status == "refused"}
    assert set(lmcache_flags.VALUE_CHECKED) | set(lmcache_flags.SWITCHES_REFUSED_ON) <= set(table)
    example = re.search(r"`(error: --coordinator-url [^`]+)`", COMPAT.read_text())
    assert example is not None
    assert example.group(1) == "error: " + str(lmcache_flags.refusal("--coordinator-url"))


def test_compat_table_lists_every_flag_of_the_reference() -> None:
    if not REFERENCE_LMCACHE.exists():
        pytest.skip(
            f"LMCache is not installed at {REFERENCE_LMCACHE} "
            "(scripts/install_reference_lmcache.sh installs it; LMCACHE_REF_VENV moves it)"
        )
    done = subprocess.run(
        [str(REFERENCE_LMCACHE), "server", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "DO_NOT_TRACK": "1",
            "LMCACHE_TRACK_USAGE": "false",
            "LMCACHE_DISABLE_BANNER": "1",
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    usage = done.stdout[done.stdout.index("usage: lmcache server") :].split("\n\n")[0]
    reference = set(re.findall(r"\[(-{1,2}[\w-]+)", usage))
    assert len(reference) > 80, usage
    assert reference == set(_compat_table())
    # every "--no-..." form the reference accepts is taken or refused here too
    options = _serve_option_names()
    for negative in re.findall(r"\| (--no-[\w-]+)", usage):
        assert negative in options, negative
