"""``--frontend`` / ``[[frontends]]``: what runs, and the mistakes refused before L1 exists."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from thirdparty import free_port, run_cli, run_cli_in_process

from lmcache_tiers.config import ServerConfig, build_config
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.frontend import check_frontends
from lmcache_tiers.plugins import load_registry


def frontends(*specs: dict[str, object], **server: object) -> ServerConfig:
    return build_config(load_registry(), overrides=server, frontend_json=[json.dumps(s) for s in specs])


def test_without_a_front_end_the_native_one_serves_on_host_and_port() -> None:
    config = build_config(load_registry(), overrides={"port": 6000})
    assert [spec.type for spec in config.frontends] == ["native"]
    assert config.frontends[0].config.address(config) == ("127.0.0.1", 6000)


def test_front_ends_come_from_a_toml_table(tmp_path: Path) -> None:
    from lmcache_tiers.config import load_toml

    path = tmp_path / "tiers.toml"
    path.write_text('[[frontends]]\ntype = "lmcache_mp"\nport = 5599\n\n[[frontends]]\ntype = "native"\n')
    config = build_config(load_registry(), file_values=load_toml(str(path)))
    assert [(spec.type, spec.config.port) for spec in config.frontends] == [
        ("lmcache_mp", 5599),
        ("native", None),
    ]
    flagged = build_config(
        load_registry(), file_values=load_toml(str(path)), frontend_json=['{"type": "native", "port": 7}']
    )
    assert [spec.type for spec in flagged.frontends] == ["native"]  # the flags replace the file's list


@pytest.mark.parametrize(
    ("specs", "server", "message"),
    [
        ([{"type": "native"}, {"type": "lmcache_mp"}], {"port": 5555}, "would both listen on 127.0.0.1:5555"),
        (
            [
                {"type": "native", "port": 7000},
                {"type": "lmcache_mp", "host": "0.0.0.0", "port": 7000, "allow_remote": True},
            ],
            {},
            "0.0.0.0:7000",
        ),
        (
            [{"type": "lmcache_mp", "port": 9090}],
            {"metrics_port": 9090},
            "metrics_port 9090: the HTTP endpoint would listen on 127.0.0.1:9090, as front end 0:lmcache_mp",
        ),
        (
            [{"type": "native", "host": "localhost", "port": 7001}, {"type": "lmcache_mp", "port": 7001}],
            {},
            "would both listen",
        ),
        ([{"type": "lmcache_mp", "host": "0.0.0.0"}], {}, '"allow_remote": true'),
        ([{"type": "lmcache_mp"}], {"no_shm": True}, '"allow_pickle": true'),
        ([{"type": "lmcache_mp", "shm": False}], {}, '"allow_pickle": true'),
        ([{"type": "native", "host": "0.0.0.0"}], {}, "requires --auth-token"),
    ],
)
def test_refused_before_l1_exists(
    specs: list[dict[str, object]], server: dict[str, object], message: str
) -> None:
    config = frontends(*specs, **{"metrics_port": 0, **server})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_frontends(config, None)


def test_listeners_that_cannot_collide_pass() -> None:
    check_frontends(
        frontends({"type": "native", "port": 0}, {"type": "lmcache_mp", "port": 0}, metrics_port=0), None
    )
    check_frontends(
        frontends(
            {"type": "native", "host": "127.0.0.1"},
            {"type": "lmcache_mp", "host": "127.0.0.2"},
            port=7002,
            metrics_port=0,
        ),
        None,
    )
    check_frontends(
        frontends(
            {"type": "native", "host": "ipc:///tmp/a.sock"}, {"type": "lmcache_mp"}, port=7003, metrics_port=0
        ),
        None,
    )


def test_a_clash_is_one_line_exit_2_and_no_l1_segment() -> None:
    port = free_port()
    shm = f"tiers_clash_{uuid.uuid4().hex[:8]}"
    result = run_cli(
        [
            *("serve", "--no-default-l2", "--l1-size-gb", "2", "--shm-name", shm, "--metrics-port", "0"),
            *("--frontend", json.dumps({"type": "lmcache_mp", "port": port})),
            *("--frontend", json.dumps({"type": "native", "port": port})),
        ]
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "would both listen on" in lines[0], result.stderr
    assert not os.path.exists(f"/dev/shm/{shm}")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("{oops", "--frontend #1 is not valid JSON"),
        ('{"type": "lmcache_mpp"}', "did you mean 'lmcache_mp'?"),
        ('{"type": "lmcache_mp", "workers": 0}', "$.frontends[0].workers"),
        ('{"type": "native", "bogus": 1}', "bogus"),
    ],
)
def test_bad_frontend_json_is_one_line_exit_2(flag: str, message: str) -> None:
    result = run_cli_in_process(["serve", "--print-config", "--frontend", flag])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_print_config_shows_the_front_ends() -> None:
    result = run_cli_in_process(
        ["serve", "--print-config", "--no-default-l2", "--frontend", '{"type": "lmcache_mp"}']
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)["frontends"]
    assert shown[0]["type"] == "lmcache_mp" and shown[0]["allow_pickle"] is False
