"""``--host`` and ``--port`` are where the front ends that give no address of their own
listen.  Given while every front end gives its own, they are used by nothing: ``serve``
refuses them in one line (exit 2), naming the flag or the --config key, rather than serving
somewhere else than asked without a word."""

from __future__ import annotations

import uuid
from pathlib import Path

from thirdparty import run_cli_in_process


def _serve(args: list[str]) -> tuple[int, str]:
    shm = f"tiers_unused_{uuid.uuid4().hex[:10]}"
    result = run_cli_in_process(["serve", "--print-config", "--no-default-l2", "--shm-name", shm, *args])
    return result.returncode, result.stderr.strip()


def _refusal(args: list[str]) -> str:
    code, err = _serve(args)
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_port_flag_no_front_end_listens_on_is_refused() -> None:
    line = _refusal(["--port", "6001", "--frontend", '{"type": "native", "port": 6002}'])
    assert line.startswith("error: --port 6001: every front end gives its own port"), line


def test_a_host_flag_no_front_end_listens_on_is_refused() -> None:
    frontend = '{"type": "native", "host": "127.0.0.1"}'
    line = _refusal(["--host", "localhost", "--frontend", frontend])
    assert line.startswith("error: --host localhost: every front end gives its own host"), line


def test_a_port_in_the_config_file_no_front_end_listens_on_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    config = tmp_path / "server.toml"
    config.write_text('port = 6001\n\n[[frontends]]\ntype = "native"\nport = 6002\n')
    line = _refusal(["--config", str(config)])
    assert line.startswith(f"error: --config {config}: port 6001: every front end gives its own port"), line


def test_host_and_port_a_front_end_takes_are_accepted() -> None:
    frontends = ["--frontend", '{"type": "native", "port": 6002}', "--frontend", '{"type": "lmcache_mp"}']
    assert _serve(["--host", "127.0.0.1", "--port", "6001", *frontends]) == (0, "")
    assert _serve(["--host", "127.0.0.1", "--port", "6001"]) == (0, "")
