"""A stop signal arriving while plugins are discovered stops the command: it is never
taken for the failure of the plugin whose import or hook it happened to interrupt (that
plugin listed as broken, and the stop lost)."""

from __future__ import annotations

import signal
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakeplugins import make_module

from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.plugins import discover


class StartUpStopped(BaseException):
    """What a start-up's stop handler raises (as ``server.app.StartUpInterrupted``)."""


@pytest.fixture
def sigterm_raises() -> Iterator[dict[str, Any]]:
    """SIGTERM handled as the replay and the server's start-up do: by raising."""
    raised: dict[str, Any] = {"exception": SystemExit(128 + signal.SIGTERM)}

    def stop(signum: int, frame: Any) -> None:
        raise raised["exception"]

    previous = signal.signal(signal.SIGTERM, stop)
    yield raised
    signal.signal(signal.SIGTERM, previous)


def signalled_while_registering() -> types.ModuleType:
    """A plugin whose registration is where the stop signal lands."""
    plugin = types.ModuleType("signalled")

    @hookimpl
    def tiers_register_serdes(registry: Any) -> None:
        signal.raise_signal(signal.SIGTERM)

    plugin.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    return plugin


def test_a_sigterm_raising_system_exit_during_discovery_goes_through(sigterm_raises: dict[str, Any]) -> None:
    with pytest.raises(SystemExit) as stopped:
        discover({"signalled": signalled_while_registering(), "demo": make_module()})
    assert stopped.value.code == 128 + signal.SIGTERM


def test_a_start_up_stop_during_discovery_goes_through(sigterm_raises: dict[str, Any]) -> None:
    sigterm_raises["exception"] = StartUpStopped()
    with pytest.raises(StartUpStopped):
        discover({"signalled": signalled_while_registering(), "demo": make_module()})


def test_a_plugins_own_sys_exit_is_still_its_failure() -> None:
    exiting = types.ModuleType("exiting")

    @hookimpl
    def tiers_register_serdes(registry: Any) -> None:
        sys.exit("no GPU here")

    exiting.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"exiting": exiting, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["exiting"] == "error: SystemExit: no GPU here"


def exit_status_of_discovery_under(handler: Callable[[int, Any], None]) -> object:
    """The status of the SystemExit that a SIGTERM landing in a plugin's registration ends
    discovery with, ``handler`` handling SIGTERM meanwhile."""
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            discover({"signalled": signalled_while_registering(), "demo": make_module()})
    finally:
        signal.signal(signal.SIGTERM, previous)
    return stopped.value.code


def test_a_handler_taking_its_arguments_packed_is_told_too() -> None:
    """A handler written ``lambda *_: sys.exit(...)`` (its arguments in one tuple) is a
    stop signal's handler as much as one naming them."""
    assert exit_status_of_discovery_under(lambda *_: sys.exit(128 + signal.SIGTERM)) == 128 + signal.SIGTERM


def test_a_plugins_own_sys_exit_next_to_its_callers_frame_is_still_its_failure() -> None:
    """A plugin's hook that keeps its caller's frame (to name who registers) and exits with
    a small status looks, by its locals, like a handler called with a signal's number and
    the frame it interrupted: it is still the plugin's own failure, not a stop."""
    exiting = types.ModuleType("exiting")

    @hookimpl
    def tiers_register_serdes(registry: Any) -> None:
        caller = sys._getframe(1)  # noqa: F841 (held as a plugin that names its caller would)
        status = 2
        sys.exit(status)

    exiting.tiers_register_serdes = tiers_register_serdes  # type: ignore[attr-defined]
    plugin_set = discover({"exiting": exiting, "demo": make_module()})
    statuses = {p.name: p.status for p in plugin_set.plugins}
    assert statuses["exiting"] == "error: SystemExit: 2"
    assert statuses["demo"] == "ok"


def test_a_handler_that_ignores_further_signals_before_raising_is_told_too() -> None:
    """The replay's handler (``signals_unwind``) ignores SIGTERM and SIGINT before it
    raises: no longer installed when its SystemExit is looked at, it is a stop all the same."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    assert exit_status_of_discovery_under(stop) == 128 + signal.SIGTERM
