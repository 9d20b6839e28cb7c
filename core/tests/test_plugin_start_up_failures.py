"""A backend that fails while serve starts it: one line naming the adapter and its plugin.

Each test installs a one-file plugin (a dist-info with its entry point, put on
PYTHONPATH) whose backend constructor or plain ``open`` fails, runs ``lmcache-tiers
serve`` on it, and checks the exit status and the one error line.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from test_plugin_guide_refusals import BACKEND, error_line, guide_text, install_flat_plugin, serve

from lmcache_tiers.errors import PluginError
from lmcache_tiers.plugin import hookimpl
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import call_factory


def serve_failing(site: Path, name: str, *, construct: str = "pass", open: str = "pass") -> tuple[int, str]:
    """Exit status and error line of serve with a working mock adapter first and the
    failing backend ``name`` second (adapter 1)."""
    install_flat_plugin(site, name, BACKEND.format(name=name, construct=construct, open=open))
    result = serve(
        site,
        "--no-default-l2",
        "--l2-adapter",
        '{"type": "mock", "max_size_gb": 0.01}',
        "--l2-adapter",
        f'{{"type": "{name}"}}',
    )
    return result.returncode, error_line(result.stderr)


def named(name: str) -> str:
    """How the line names the failing adapter, the second configured."""
    return f"1:{name}: l2 adapter '{name}' from plugin 'lmcache-plugin-{name}'"


def test_a_constructor_calling_sys_exit_is_one_line_naming_the_adapter(tmp_path: Path) -> None:
    code, line = serve_failing(tmp_path, "guidequits", construct="raise SystemExit(4)")
    assert code == 1, line
    assert line == f"error: cannot start the server: {named('guidequits')} failed to start: SystemExit: 4"


def test_a_plain_open_calling_sys_exit_is_one_line_naming_the_adapter(tmp_path: Path) -> None:
    code, line = serve_failing(tmp_path, "guideopenquits", open='sys.exit("the store is gone")')
    assert code == 1, line
    assert line == (
        f"error: cannot start the server: {named('guideopenquits')} "
        "failed to open: SystemExit: the store is gone"
    )


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        ('OSError(5, "disk gone")', "OSError: [Errno 5] disk gone"),
        ('ValueError("no such region")', "ValueError: no such region"),
    ],
)
def test_an_os_or_value_error_of_a_constructor_names_the_adapter(
    tmp_path: Path, raised: str, said: str
) -> None:
    code, line = serve_failing(tmp_path, "guidector", construct=f"raise {raised}")
    assert code == 1, line
    assert line == f"error: cannot start the server: {named('guidector')} failed to start: {said}"
    assert "For an L2 backend that line names the adapter by its place and type" in guide_text()


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        ('OSError(5, "disk gone")', "OSError: [Errno 5] disk gone"),
        ('RuntimeError("the store refused the session")', "RuntimeError: the store refused the session"),
    ],
)
def test_what_a_plain_open_raises_names_the_adapter(tmp_path: Path, raised: str, said: str) -> None:
    code, line = serve_failing(tmp_path, "guideopen", open=f"raise {raised}")
    assert code == 1, line
    assert line == f"error: cannot start the server: {named('guideopen')} failed to start: {said}"


def test_a_field_error_of_a_constructor_names_the_adapter_and_the_value_s_path(tmp_path: Path) -> None:
    code, line = serve_failing(
        tmp_path, "guidefield", construct='raise FieldError("circuit", "no breaker here")'
    )
    assert code == 2, line
    assert line == f"error: {named('guidefield')}: no breaker here - at `$.l2_adapters[1].circuit`"
    assert "refuses its config like one from `__post_init__`, naming the adapter and the value's path" in (
        guide_text()
    )


def _interrupted() -> None:
    raise KeyboardInterrupt


def _quits() -> None:
    raise SystemExit(3)


def test_a_factory_s_ctrl_c_on_the_main_thread_goes_on_up() -> None:
    with pytest.raises(KeyboardInterrupt):
        call_factory(_interrupted, "serde:x from plugin 'p'")


def test_a_factory_s_sys_exit_is_the_plugin_s_error() -> None:
    with pytest.raises(PluginError, match=r"^serde:x from plugin 'p' failed to start: SystemExit: 3$"):
        call_factory(_quits, "serde:x from plugin 'p'")


def test_a_field_error_of_a_wrapped_backend_names_the_path_of_the_inner_value(tmp_path: Path) -> None:
    refusal = 'raise FieldError("circuit", "no breaker here")'
    install_flat_plugin(
        tmp_path, "guideinner", BACKEND.format(name="guideinner", construct=refusal, open="pass")
    )
    result = serve(
        tmp_path,
        "--no-default-l2",
        "--l2-adapter",
        '{"type": "fault_inject", "inner": {"type": "guideinner"}}',
    )
    assert result.returncode == 2, result.stderr
    assert error_line(result.stderr) == (
        "error: 0:fault_inject `inner` 'guideinner' from plugin 'lmcache-plugin-guideinner': "
        "no breaker here - at `$.l2_adapters[0].inner.circuit`"
    )


def _returns_a_count(registry: object) -> int:
    return 1


def test_a_registration_hook_returning_an_int_is_told_in_words() -> None:
    module = types.ModuleType("tiers_unit_returns_a_count")
    module.tiers_register_serdes = hookimpl(_returns_a_count)  # type: ignore[attr-defined]
    info = next(p for p in discover({"counts": module}).plugins if p.name == "counts")
    assert info.error is not None
    assert info.error.startswith("tiers_register_serdes returned an int, which is ignored: "), info.error
