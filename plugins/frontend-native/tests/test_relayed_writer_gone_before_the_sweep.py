"""The fence of a relayed writer that exited before any sweep looked at its fences.

Behind a relay the kernel names no writer (the relay maps no arena), and the pid the
client's HELLO reported stands in.  Its process was watched (a pidfd opened, its maps
read) only once first needed: at the first sweep after the reservation was fenced.  A
writer that died holding the reservation -- what a fence is for -- was gone by then: no
pidfd could be opened on its pid, nothing proved it had been the writer, and its expired
reservation stayed fenced until the server stopped.  The process the HELLO pid names is
pinned by a pidfd at the connection's first request, and its maps read by the lookup of
the connection while it lives; that pin is the writer's watch, so its exit before the
sweep is seen as the exit of that very process.

Every process here is a real one: the relay (mapping no arena) and the writer (mapping
the arena, as clients do).  The sweeps that give fences back are held until the writer
has exited.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest
from native_fence_support import SHORT_TTL
from native_keys import leases_of, stats_of
from native_stop import wait_for
from test_fence_waits_for_the_writer_known_at_reservation import (
    HeldSweeps,
    fenced,
    relayed_writer_reserved,
)

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.children import end


def test_a_relayed_writer_gone_before_the_first_sweep_has_its_fence_lifted(
    make_server: Callable[..., TiersServer],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    sweeps = HeldSweeps(server, monkeypatch)
    writer, _, _ = relayed_writer_reserved(server, processes)
    end(writer)  # dies holding its reservation, which no sweep has looked at yet
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    sweeps.let_go()
    sweeps.wait_for_two()
    assert fenced(server) == 0, "the fence of the exited writer stayed"
    assert leases_of(server)["reclaimed_writer_done"] == 1
    assert stats_of(server).failures["peer_not_writer"] == 1


def test_a_relayed_writer_alive_keeps_its_fence(
    make_server: Callable[..., TiersServer],
    processes: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server(**SHORT_TTL)
    sweeps = HeldSweeps(server, monkeypatch)
    writer, _, _ = relayed_writer_reserved(server, processes)
    wait_for(lambda: fenced(server) == 1, "the expired reservation fenced")
    sweeps.let_go()
    sweeps.wait_for_two()
    assert fenced(server) == 1, "the fence was lifted while its writer lived"
    end(writer)
    sweeps.wait_for_two()
    assert fenced(server) == 0
