import msgspec
import pytest
from fakeplugins import make_module

from lmcache_tiers.config import (
    ServerConfig,
    build_config,
    config_to_builtins,
    load_toml,
    parse_adapter_json,
    redact_secrets,
)
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry


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
        ('{"type": "demo", "eviction": {"eviction_policy": "LFU"}}', r"unknown eviction policy 'LFU'"),
        ("[1, 2]", r"expected a JSON object"),
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
        ({"eviction_policy": "lru2"}, r"unknown eviction policy 'lru2': did you mean 'LRU'\?"),
        ({"l2_store_policy": "nope"}, r"unknown store policy 'nope'"),
        ({"l2_prefetch_max_in_flight": 0}, r"at `\$\.l2_prefetch_max_in_flight`"),
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
