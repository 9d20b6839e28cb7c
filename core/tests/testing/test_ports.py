"""The loopback ports handed out to the servers tests start: never one the kernel may give
a connection's local end, never one another process was handed, never one in use."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.testing import ports as ports_module
from lmcache_tiers.testing.ports import (
    LEASE_S,
    PortLeases,
    candidate_ports,
    ephemeral_range,
    free_port,
    free_ports,
)


def test_ports_handed_out_lie_outside_the_kernels_ephemeral_range() -> None:
    low, high = ephemeral_range()
    handed = free_ports(20) + [free_port() for _ in range(20)]
    assert len(set(handed)) == len(handed)
    assert [port for port in handed if low <= port <= high] == [], (low, high)


@pytest.mark.parametrize(
    ("ephemeral", "first", "last", "count"),
    [
        ((32768, 60999), 20000, 65535, 12768 + 4536),  # Linux's default
        ((20000, 65535), 1024, 19999, 18976),  # too few above the floor: from 1024 up
        ((1024, 65535), 20000, 65535, 45536),  # nothing outside: its own ports
    ],
)
def test_the_candidates_follow_the_ephemeral_range(
    ephemeral: tuple[int, int], first: int, last: int, count: int
) -> None:
    candidates = candidate_ports(ephemeral)
    assert (candidates[0], candidates[-1], len(candidates)) == (first, last, count)
    if count != 45536:
        assert not [port for port in candidates if ephemeral[0] <= port <= ephemeral[1]]


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    written = tmp_path / "ip_local_port_range"
    written.write_text("40000\t50000\n")
    assert ephemeral_range(written) == (40000, 50000)
    assert ephemeral_range(tmp_path / "absent") == (32768, 65535)


@pytest.fixture
def three_ports() -> list[int]:
    """Three ports leased to this process in the shared table: no one else uses them."""
    return free_ports(3)


def test_a_port_in_use_or_in_time_wait_is_skipped(tmp_path: Path, three_ports: list[int]) -> None:
    listening, waiting, free = three_ports
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", waiting))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", waiting))
        accepted, _ = listener.accept()
        accepted.close()  # the server's end closes first: its port stays in TIME_WAIT
        client.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", listening))
        busy.listen()
        leases = PortLeases(tmp_path / "leases", three_ports)
        assert leases.take(1) == [free]


def test_a_lease_keeps_the_port_from_every_process_until_it_ends(
    tmp_path: Path, three_ports: list[int]
) -> None:
    now = [1000.0]
    table = tmp_path / "leases"
    first, second = (PortLeases(table, three_ports[:2], clock=lambda: now[0]) for _ in range(2))
    assert first.take(1) == [three_ports[0]]
    assert second.take(1) == [three_ports[1]]  # the same start, and the first port is leased
    with pytest.raises(OSError, match="no 1 loopback ports free and unleased among 2"):
        second.take(1)
    now[0] += LEASE_S - 1
    with pytest.raises(OSError):
        first.take(1)
    now[0] += 3
    assert second.take(2) == three_ports[:2]


def test_a_partner_port_is_leased_with_its_port(tmp_path: Path) -> None:
    ports = candidate_ports(ephemeral_range())
    leases = PortLeases(tmp_path / "leases", ports)
    handed = leases.take(3, partner_offset=10000)
    partners = [port + 10000 for port in handed]
    assert set(partners) <= set(ports) and not set(partners) & set(handed)
    others = PortLeases(tmp_path / "leases", partners)
    with pytest.raises(OSError):
        others.take(1)


TAKER = """
import sys
from pathlib import Path
from lmcache_tiers.testing.ports import PortLeases

table, first, count, takes = Path(sys.argv[1]), *map(int, sys.argv[2:])
leases = PortLeases(table, range(first, first + count))
sys.stdin.read(1)  # every taker starts at once
print(" ".join(str(leases.take(1)[0]) for _ in range(takes)), flush=True)
"""


@pytest.fixture
def taker_processes(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    first = candidate_ports(ephemeral_range())[0]
    takers = [
        subprocess.Popen(
            [sys.executable, "-c", TAKER, str(tmp_path / "leases"), str(first), "400", "60"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        yield takers
    finally:
        for taker in takers:
            taker.kill()
            taker.wait()


def test_processes_taking_ports_at_once_never_take_the_same_one(
    taker_processes: list[subprocess.Popen[str]],
) -> None:
    for taker in taker_processes:
        assert taker.stdin is not None
        taker.stdin.write("go")
        taker.stdin.close()
    handed = []
    for taker in taker_processes:
        assert taker.stdout is not None
        handed.append(taker.stdout.read().split())
        assert taker.wait(timeout=120) == 0
    assert [len(ports) for ports in handed] == [60] * 4
    every = [port for ports in handed for port in ports]
    assert len(set(every)) == len(every)


def test_the_table_is_opened_for_each_hand_out_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No descriptor is kept between hand-outs: tests counting open files see none."""
    monkeypatch.setattr(ports_module, "LEASE_TABLE", tmp_path / "leases")
    monkeypatch.setattr(ports_module, "_leases", None)
    before = len(list(Path("/proc/self/fd").iterdir()))
    free_ports(2)
    assert len(list(Path("/proc/self/fd").iterdir())) == before
    assert (tmp_path / "leases").stat().st_size > 0
