"""A policy, serde or front end whose factory raises: one line naming it.

``call_factory`` hands a factory's ``OSError`` and ``ValueError`` back as they are, for
callers that explain them; serve's line for a policy, a serde or a front end then said
``[Errno 5] disk gone`` with no word of whose it was.  Each test installs a one-file
plugin (a dist-info with its entry point, put on PYTHONPATH) registering one component
of each kind whose factory raises, and runs ``lmcache-tiers serve`` on one of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plugin_guide_refusals import error_line, guide_text, install_flat_plugin, serve

PLUGIN = """
from lmcache_tiers.plugin import ComponentConfig, FieldError, FrontendConfig, hookimpl


class Options(ComponentConfig):
    pass


class FrontOptions(FrontendConfig):
    pass


def failing(*args):
    {raise_}


@hookimpl
def tiers_register_eviction_policies(registry):
    registry.add("startfail_evict", failing, Options)


@hookimpl
def tiers_register_serdes(registry):
    registry.add("startfail_serde", failing, Options)


@hookimpl
def tiers_register_frontends(registry):
    registry.add("startfail_front", failing, FrontOptions)
"""

ORIGIN = "from plugin 'lmcache-plugin-startfail'"

#: (serve flags, how the line names the component, where its config sits)
CONFIGURED = {
    "eviction policy": (
        ["--eviction-policy", "startfail_evict"],
        f"eviction_policy:startfail_evict {ORIGIN}",
        "",
    ),
    "serde": (
        ["--l2-adapter", '{"type": "mock", "max_size_gb": 0.01, "serde": [{"type": "startfail_serde"}]}'],
        f"0:mock: serde[0] serde:startfail_serde {ORIGIN}",
        "$.l2_adapters[0].serde[0]",
    ),
    "front end": (
        ["--frontend", '{"type": "startfail_front"}'],
        f"front end 0:startfail_front: frontend:startfail_front {ORIGIN}",
        "$.frontends[0]",
    ),
}


def serve_failing(site: Path, kind: str, raise_: str) -> tuple[int, str]:
    install_flat_plugin(site, "startfail", PLUGIN.format(raise_=raise_))
    result = serve(site, "--no-default-l2", *CONFIGURED[kind][0])
    return result.returncode, error_line(result.stderr)


@pytest.mark.parametrize(
    ("kind", "raised", "said"),
    [
        ("eviction policy", 'OSError(5, "disk gone")', "OSError: [Errno 5] disk gone"),
        ("serde", 'OSError(5, "disk gone")', "OSError: [Errno 5] disk gone"),
        # (a front end's OSError is its address refused: the server's listen error)
        *((kind, 'ValueError("no such depth")', "ValueError: no such depth") for kind in CONFIGURED),
    ],
)
def test_an_error_of_the_factory_names_the_component(
    tmp_path: Path, kind: str, raised: str, said: str
) -> None:
    code, line = serve_failing(tmp_path, kind, f"raise {raised}")
    assert code == 1, line
    assert line == f"error: cannot start the server: {CONFIGURED[kind][1]} failed to start: {said}"


@pytest.mark.parametrize("kind", list(CONFIGURED))
def test_a_field_error_of_the_factory_is_a_config_error_naming_the_value(tmp_path: Path, kind: str) -> None:
    code, line = serve_failing(tmp_path, kind, 'raise FieldError("depth", "must be positive")')
    assert code == 2, line
    _, named, path = CONFIGURED[kind]
    where = f"- at `{path}.depth`" if path else "(field 'depth')"
    assert line == f"error: {named}: must be positive {where}"


def test_the_plugin_guide_says_so() -> None:
    guide = guide_text()
    assert "eviction_policy:NAME from plugin 'DIST' failed to start: ValueError:" in guide
    assert "`0:mock: serde[0] serde:NAME ...`" in guide
