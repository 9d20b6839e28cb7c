import builtins
import time
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fakeplugins import make_module

from lmcache_tiers.config import (
    MAX_VALUE_DEPTH,
    L2AdapterConfig,
    ServerConfig,
    build_config,
    config_to_builtins,
    file_fields,
    load_toml,
    parse_adapter_json,
    redact_secrets,
    redact_url_secrets,
)
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry, KindRegistry


@pytest.fixture(scope="module")
def registry() -> ComponentRegistry:
    return discover({"demo": make_module()}).registry


def test_defaults_follow_lmcache(registry: ComponentRegistry) -> None:
    config = build_config(registry)
    assert config.eviction_trigger_watermark == 0.8
    assert config.eviction_ratio == 0.2
    assert config.l2_prefetch_max_in_flight == 8
    assert config.l2_store_policy == "default" and config.l2_prefetch_policy == "default"
    assert config.port == 5555 and config.host == "127.0.0.1"


def test_adapter_json_selects_plugin_struct(registry: ComponentRegistry) -> None:
    spec = parse_adapter_json(
        registry, '{"type": "demo", "size_gb": 2, "eviction": {"trigger_watermark": 0.5}}', 0
    )
    assert spec.type == "demo"
    assert spec.config.size_gb == 2.0  # type: ignore[attr-defined]
    assert spec.config.eviction is not None and spec.config.eviction.trigger_watermark == 0.5


def test_order_of_adapters_is_kept(registry: ComponentRegistry) -> None:
    config = build_config(
        registry, adapter_json=['{"type":"demo","path":"/a"}', '{"type":"demo","path":"/b"}']
    )
    assert [a.config.path for a in config.l2_adapters] == ["/a", "/b"]  # type: ignore[attr-defined]


def test_serde_chain_is_resolved(registry: ComponentRegistry) -> None:
    spec = parse_adapter_json(registry, '{"type":"demo","serde":[{"type":"zdemo","level":5}]}', 0)
    assert spec.serde[0].type == "zdemo" and spec.serde[0].config.level == 5  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"\$\.l2_adapters\[0\]\.serde\[0\]\.level"):
        parse_adapter_json(registry, '{"type":"demo","serde":[{"type":"zdemo","level":50}]}', 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", r"--l2-adapter #1 is not valid JSON"),
        ('{"type": "dmeo"}', r"unknown l2 adapter 'dmeo': did you mean 'demo'\? installed: (.*, )?demo\b"),
        ('{"size_gb": 1}', r"missing required field `type`"),
        # not read as the text "None" or "1": the value given is named as it was written
        (
            '{"type": null}',
            r"^`type` must be a string naming an installed l2 adapter, got null "
            r".* at `\$\.l2_adapters\[0\]\.type`$",
        ),
        ('{"type": 1}', r"^`type` must be a string .*, got 1 "),
        (
            '{"type": "demo", "serde": [{"type": ["zdemo"]}]}',
            r"installed serde, got list .* at `\$\.l2_adapters\[0\]\.serde\[0\]\.type`$",
        ),
        (
            '{"type": "demo", "size_gb": -1}',
            r"demo: Expected `float` > 0.* at `\$\.l2_adapters\[0\]\.size_gb`",
        ),
        (
            '{"type": "demo", "size_gb": "big"}',
            r"Expected `float`, got `str` - at `\$\.l2_adapters\[0\]\.size_gb`",
        ),
        ('{"type": "demo", "colour": "red"}', r"unknown field `colour`"),
        (
            '{"type": "demo", "eviction": {"eviction_ratio": 2}}',
            r"\$\.l2_adapters\[0\]\.eviction\.eviction_ratio",
        ),
        (
            '{"type": "demo", "eviction": {"eviction_policy": "LFU"}}',
            r"unknown eviction policy 'LFU'.* - at `\$\.l2_adapters\[0\]\.eviction\.eviction_policy`",
        ),
        ("[1, 2]", r"expected a JSON object"),
        # JSON parsers keep the last of two equal keys: the first value would be dropped unsaid
        (
            '{"type": "demo", "path": "/a", "path": "/b"}',
            r"^--l2-adapter #1 is not valid config JSON: key `path` is given twice in one object",
        ),
        (
            '{"type": "demo", "eviction": {"eviction_ratio": 0.1, "eviction_ratio": 0.9}}',
            r"key `eviction_ratio` is given twice",
        ),
        # nested past the parser's recursion limit: one line, not a RecursionError
        (
            '{"type": "demo", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            r"^--l2-adapter #1 .*nested too deeply",
        ),
    ],
)
def test_bad_adapter_json(registry: ComponentRegistry, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(registry, adapter_json=[text])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction_ratio": 1.5}, r"Expected `float` <= 1.0 - at `\$\.eviction_ratio`"),
        ({"port": 70000}, r"at `\$\.port`"),
        (
            {"eviction_policy": "lru2"},
            r"unknown eviction policy 'lru2': did you mean 'LRU'\?.* - at `\$\.eviction_policy`",
        ),
        ({"l2_store_policy": "nope"}, r"unknown store policy 'nope'.* - at `\$\.l2_store_policy`"),
        ({"l2_prefetch_policy": "nope"}, r"unknown prefetch policy 'nope'.* - at `\$\.l2_prefetch_policy`"),
        ({"l2_prefetch_max_in_flight": 0}, r"at `\$\.l2_prefetch_max_in_flight`"),
        # the wire protocols carry it as a 64-bit integer: a larger one fails every client's hello
        ({"chunk_size": 1 << 64}, r"chunk_size .* 64-bit .* - at `\$\.chunk_size`"),
        # carried in /status and the STATUS reply: a larger one fails every status request
        ({"l2_prefetch_max_in_flight": 1 << 64}, r"<= 922\d+ - at `\$\.l2_prefetch_max_in_flight`"),
    ],
)
def test_bad_scalar_values(registry: ComponentRegistry, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(registry, overrides=overrides)


def test_policy_names_are_case_insensitive(registry: ComponentRegistry) -> None:
    assert build_config(registry, overrides={"eviction_policy": "lru"}).eviction_policy == "lru"


def test_toml_file_and_flag_precedence(registry: ComponentRegistry, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text('l1_size_gb = 2.5\nport = 6000\n[[l2_adapters]]\ntype = "demo"\npath = "/from-file"\n')
    config = build_config(registry, load_toml(str(path)), {"port": 7000, "host": None})
    assert config.l1_size_gb == 2.5 and config.port == 7000
    assert config.l2_adapters[0].config.path == "/from-file"  # type: ignore[attr-defined]
    flagged = build_config(registry, load_toml(str(path)), adapter_json=['{"type":"demo","path":"/flag"}'])
    assert [a.config.path for a in flagged.l2_adapters] == ["/flag"]  # type: ignore[attr-defined]


def test_unknown_toml_field_and_bad_toml(registry: ComponentRegistry, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text("l1_sise_gb = 2\n")
    with pytest.raises(ConfigError, match=r"unknown config field `\$\.l1_sise_gb`"):
        build_config(registry, load_toml(str(path)))
    path.write_text("l1_size_gb = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(str(tmp_path / "missing.toml"))


def test_resolved_config_round_trips_through_builtins(registry: ComponentRegistry) -> None:
    config = build_config(registry, adapter_json=['{"type":"demo","serde":[{"type":"zdemo"}]}'])
    data = config_to_builtins(config)
    assert data["l2_adapters"][0]["type"] == "demo"
    assert list(data["l2_adapters"][0]["serde"]) == [{"type": "zdemo", "level": 3}]
    again = build_config(registry, data)
    assert again == config


def test_server_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ServerConfig().port = 1  # type: ignore[misc]
    assert msgspec.structs.replace(ServerConfig(), port=1).port == 1


def test_secret_named_values_are_redacted_at_any_depth() -> None:
    data = {
        "auth_token": "t0ken",
        "port": 5555,
        "l2_adapters": [
            {"type": "remote", "aws_secret_access_key": "s3cret", "aws_access_key_id": None, "bucket": "b"},
            {"type": "other", "backend_params": {"access_key": "k", "host": "x"}, "password": ""},
        ],
    }
    assert redact_secrets(data) == {
        "auth_token": "***",
        "port": 5555,
        "l2_adapters": [
            {"type": "remote", "aws_secret_access_key": "***", "aws_access_key_id": None, "bucket": "b"},
            {"type": "other", "backend_params": {"access_key": "***", "host": "x"}, "password": ""},
        ],
    }
    assert data["auth_token"] == "t0ken", "the input is left alone"


def test_passwords_inside_urls_are_redacted() -> None:
    shown = redact_secrets(
        {"url": "redis://u:pw1@h:1/0", "other": "rediss://h:2/0?db=1&password=pw2&ssl_auth_token=pw3#x"}
    )
    assert shown == {
        "url": "redis://u:***@h:1/0",
        "other": "rediss://h:2/0?db=1&password=***&ssl_auth_token=***#x",
    }


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # the user information ends at the last "@" of the authority, as URL parsers (and
        # redis-py) read it: a password holding "@" is hidden whole
        ("redis://u:p@ss@h:1/0", "redis://u:***@h:1/0"),
        ("redis://:p@ss@h", "redis://:***@h"),
        # a user name holding "@" still has its password hidden
        ("redis://u@corp:pw@h:1", "redis://u@corp:***@h:1"),
        # nor one holding an unescaped "?" or "#"
        ("redis://u:p?w#d@h/0", "redis://u:***@h/0"),
        # an "@" past the authority is no user information
        ("redis://h:1/0?x=a:b@c", "redis://h:1/0?x=a:b@c"),
        ("see 'redis://u:p@w@h' and redis://v:q@h2", "see 'redis://u:***@h' and redis://v:***@h2"),
        # URLs written one after another without a space (a list of nodes, compact JSON)
        ("redis://u:p@h:1,redis://x:y@z:2/0", "redis://u:***@h:1,redis://x:***@z:2/0"),
        ('{"a":"redis://u:p@h","b":"rediss://v:q@h2"}', '{"a":"redis://u:***@h","b":"rediss://v:***@h2"}'),
        # a URL right after a word character (a name joined to it with "_") is a URL all the same
        ("node_redis://u:pw@h", "node_redis://u:***@h"),
        # a credential parameter after another parameter's value holding a "?"
        ("redis://h/0?db=a?password=pw", "redis://h/0?db=a?password=***"),
        # a credential parameter whose name holds a "?" after the credential word
        ("redis://h/0?password?=pw", "redis://h/0?password?=***"),
        ("redis://h/0?db=1&token?x=pw#f", "redis://h/0?db=1&token?x=***#f"),
    ],
)
def test_url_password_holding_at_signs_is_redacted_whole(url: str, shown: str) -> None:
    assert redact_secrets({"url": url}) == {"url": shown}


@pytest.mark.parametrize(
    "text",
    [
        "redis://" + "a" * 200_000,  # a long authority
        "a." * 100_000,  # a long run of scheme characters
        "?password" * 20_000,  # parameter names over and over, no "="
        "?" * 200_000,
        "&password?" * 20_000,  # a credential name holding "?", no "="
    ],
    ids=["authority", "scheme-run", "query-names", "question-marks", "query-names-with-question-marks"],
)
def test_redacting_a_long_text_takes_linear_time(text: str) -> None:
    # Error lines quote what the user gave (a config value, a whole file's line): a
    # redaction that backtracks turned one bad value into a hang instead of an error.
    began = time.perf_counter()
    assert redact_url_secrets(text) == text
    assert time.perf_counter() - began < 2.0


@pytest.mark.parametrize(
    ("file_text", "overrides", "adapter", "message"),
    [
        (
            "",
            {"l1_size_gb": float("inf")},
            None,
            r"^Expected a finite number, got inf - at `\$\.l1_size_gb`$",
        ),
        ("l1_lock_ttl_s = inf\n", {}, None, r"got inf - at `\$\.l1_lock_ttl_s`$"),
        ("l1_write_ttl_s = nan\n", {}, None, r"got nan - at `\$\.l1_write_ttl_s`$"),
        (
            "",
            {},
            '{"type": "demo", "size_gb": 1e400}',
            r"^demo: Expected a finite number, got inf - at `\$\.l2_adapters\[0\]\.size_gb`$",
        ),
        (
            "",
            {},
            '{"type": "demo", "serde": [{"type": "zdemo", "level": -Infinity}]}',
            r"^zdemo: Expected a finite number, got -inf - at `\$\.l2_adapters\[0\]\.serde\[0\]\.level`$",
        ),
        (
            '[[l2_adapters]]\ntype = "demo"\ncircuit = {call_timeout_s = inf}\n',
            {},
            None,
            r"^demo: .* - at `\$\.l2_adapters\[0\]\.circuit\.call_timeout_s`$",
        ),
        # A NUL ends a path at the system call: Python's open() raises ValueError for it.
        (
            "",
            {},
            '{"type": "demo", "path": "/tmp/a\\u0000b"}',
            r"^demo: Expected a string without NUL characters - at `\$\.l2_adapters\[0\]\.path`$",
        ),
        (
            '[[l2_adapters]]\ntype = "demo"\nserde = [{type = "zdemo", note = "\\u0000"}]\n',
            {},
            None,
            r"^zdemo: Expected a string without NUL .* `\$\.l2_adapters\[0\]\.serde\[0\]\.note`$",
        ),
        # A lone surrogate (JSON's "\ud800", or a non-UTF-8 byte of a flag, which Python
        # reads as "\udcff") is no text: encoding it for a socket, a file or a printed
        # config raises UnicodeEncodeError.
        (
            "",
            {},
            '{"type": "demo", "path": "/tmp/a\\ud800"}',
            r"^demo: Expected UTF-8 text, got a lone surrogate \\ud800 - at `\$\.l2_adapters\[0\]\.path`$",
        ),
        (
            "",
            {"auth_token": "\udcff"},
            None,
            r"^Expected UTF-8 text, got a lone surrogate \\udcff - at `\$\.auth_token`$",
        ),
    ],
)
def test_infinity_nan_and_nul_characters_are_refused_wherever_they_are_written(
    registry: ComponentRegistry,
    tmp_path: Path,
    file_text: str,
    overrides: dict[str, object],
    adapter: str | None,
    message: str,
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(file_text)
    with pytest.raises(ConfigError, match=message):
        build_config(registry, load_toml(str(path)), overrides, [adapter] if adapter else None)


def test_sizes_in_gib_have_a_ceiling_that_still_converts_to_bytes(registry: ComponentRegistry) -> None:
    with pytest.raises(ConfigError, match=r"Expected `float` <= 1073741824.0 - at `\$\.l1_size_gb`"):
        build_config(registry, overrides={"l1_size_gb": 1e308})
    assert build_config(registry, overrides={"l1_size_gb": 2.0**30}).l1_size_bytes == 1 << 60
    with pytest.raises(ConfigError, match=r"call_timeout_s"):
        build_config(registry, adapter_json=['{"type": "demo", "circuit": {"call_timeout_s": 1e10}}'])


def test_dashed_keys_of_a_config_file_are_its_fields(registry: ComponentRegistry, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('l1-size-gb = 2.0\n[[l2-adapters]]\ntype = "demo"\npath = "/dashed"\n')
    assert file_fields(load_toml(str(path))) == {
        "l1_size_gb": 2.0,
        "l2_adapters": [{"type": "demo", "path": "/dashed"}],
    }
    config = build_config(registry, load_toml(str(path)))
    assert config.l1_size_gb == 2.0 and config.l2_adapters[0].config.path == "/dashed"  # type: ignore[attr-defined]
    path.write_text("l1_size_gb = 1.0\nl1-size-gb = 2.0\n")
    with pytest.raises(
        ConfigError, match=r"`\$\.l1_size_gb` is given twice \(as `l1_size_gb` and `l1-size-gb`\)"
    ):
        file_fields(load_toml(str(path)))


def test_a_config_file_that_cannot_be_read_is_one_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"^config file '.*' is a directory; give the path of a TOML file$"):
        load_toml(str(tmp_path))
    deep = tmp_path / "deep.toml"  # nested past the parser's recursion limit, yet small
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"^config file '.*' is not valid TOML: .*nested too deeply"):
        load_toml(str(deep))
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not valid TOML: it is not UTF-8 text \(byte 12\)$"):
        load_toml(str(latin1))

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(builtins, "open", refused)
    with pytest.raises(ConfigError, match=r"cannot be read: this user may not read it$"):
        load_toml(str(latin1))


@pytest.mark.parametrize("name", ["a/b", "..", ".", "x" * 201, "sp ace", "", "seg\n"])
def test_a_shared_memory_name_the_arena_refuses_is_a_config_error(
    registry: ComponentRegistry, name: str
) -> None:
    with pytest.raises(ConfigError, match=r" - at `\$\.l1_shm_name`$"):
        build_config(registry, overrides={"l1_shm_name": name})
    assert build_config(registry, overrides={"l1_shm_name": "tiers_a.b-1"}).l1_shm_name == "tiers_a.b-1"


class _WrapperConfig(L2AdapterConfig):
    """A wrapper adapter, as fault_inject is: the spec of the adapter it wraps in ``inner``."""

    inner: dict[str, Any]


def _wrapper_module() -> types.ModuleType:
    module = types.ModuleType("wrapper")

    @hookimpl
    def tiers_register_l2_adapters(registry: KindRegistry) -> None:
        registry.add("wrap", "json:dumps", _WrapperConfig)

    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("source", ["flag", "file"])
def test_wrappers_nested_too_deeply_are_one_config_error(source: str) -> None:
    # Each wrapper's inner spec is decoded (and later built) on its own, outside the
    # value-depth check: a few hundred levels, well within the JSON parser's limit, ended
    # in a RecursionError naming nothing.
    # Then --print-config's redaction (and the start-up building each wrapper) recursed past
    # the stack.
    registry = discover({"demo": make_module(), "wrapper": _wrapper_module()}).registry

    def wrapped(depth: int) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": "demo"}
        for _ in range(depth):
            spec = {"type": "wrap", "inner": spec}
        return spec

    for depth in (700, MAX_VALUE_DEPTH + 1):
        spec = wrapped(depth)
        with pytest.raises(
            ConfigError, match=r"wrappers nested more than 32 deep - at `\$\.l2_adapters\[0\]"
        ) as caught:
            config = build_config(
                registry,
                adapter_json=[_deep_json(depth)] if source == "flag" else None,
                file_values=None if source == "flag" else {"l2_adapters": [spec]},
            )
            redact_secrets(config_to_builtins(config))
        assert "\n" not in str(caught.value)
    # MAX_VALUE_DEPTH wrappers: accepted, and printed
    (adapter,) = build_config(registry, file_values={"l2_adapters": [wrapped(MAX_VALUE_DEPTH)]}).l2_adapters
    assert adapter.type == "wrap"


def _deep_json(depth: int) -> str:
    # json.dumps recurses as well: written out
    return '{"type": "wrap", "inner": ' * depth + '{"type": "demo"}' + "}" * depth


@pytest.mark.parametrize(
    ("overrides", "frontend", "path"),
    [
        ({"host": ""}, None, r"\$\.host"),
        ({}, '{"type": "native", "host": ""}', r"\$\.frontends\[0\]\.host"),
    ],
)
def test_an_empty_listening_host_is_refused(
    overrides: dict[str, Any], frontend: str | None, path: str
) -> None:
    """ "" names no address: libzmq would refuse to bind it once the server is built, as a
    failure of the port."""
    registry = discover({}).registry
    with pytest.raises(ConfigError, match=rf"Expected `str` of length >= 1 - at `{path}`$"):
        build_config(registry, overrides=overrides, frontend_json=[frontend] if frontend else None)
    assert build_config(registry, overrides={"host": "*"}).host == "*"


def test_an_empty_auth_token_is_refused(registry: ComponentRegistry) -> None:
    """ "" would be read as no token: on loopback the server would start without
    authentication although one was asked for (``--auth-token "$UNSET"``)."""
    with pytest.raises(ConfigError, match=r"^auth_token is empty, .* - at `\$\.auth_token`$"):
        build_config(registry, overrides={"auth_token": ""})
    with pytest.raises(ConfigError, match=r" - at `\$\.auth_token`$"):
        build_config(registry, {"auth_token": ""})
    assert build_config(registry, overrides={"auth_token": "s3cret"}).auth_token == "s3cret"
