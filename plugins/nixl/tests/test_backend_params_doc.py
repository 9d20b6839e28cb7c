"""The reference's description of ``backend_params`` names the keys an adapter cannot start
without: each one it names as needed is refused when left out, and each one refused when
left out is named."""

from __future__ import annotations

import json

import msgspec
import pytest
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig

from lmcache_tiers.config import parse_adapter_json
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

FILE_PARAMS = {"file_path": "/data/lmcache/l2", "use_direct_io": "false"}
CASES = [
    ("nixl_store", {"pool_size": 8}, FILE_PARAMS),
    ("nixl_store_dynamic", {}, {**FILE_PARAMS, "max_capacity_gb": "10"}),
]


def description(struct: type[msgspec.Struct]) -> str:
    [field] = [f for f in msgspec.structs.fields(struct) if f.name == "backend_params"]
    meta = [m for m in getattr(field.type, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
    return " ".join(m.description or "" for m in meta)


@pytest.mark.parametrize(("kind", "extra", "params"), CASES)
def test_every_needed_key_is_named_and_refused_when_left_out(
    kind: str, extra: dict[str, object], params: dict[str, str]
) -> None:
    text = description(NixlStoreDynamicConfig if kind == "nixl_store_dynamic" else NixlStoreConfig)
    registry = load_registry()
    spec = {"type": kind, "backend": "POSIX", **extra}
    parse_adapter_json(registry, json.dumps({**spec, "backend_params": params}), 0)
    for key in params:
        assert key in text, f"{key} is needed but the description does not name it"
        left_out = {k: v for k, v in params.items() if k != key}
        with pytest.raises(ConfigError, match=rf"backend_params\.{key}"):
            parse_adapter_json(registry, json.dumps({**spec, "backend_params": left_out}), 0)
    assert "max_capacity_gb (GiB)" in text and "needs" in text
