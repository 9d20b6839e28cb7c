"""LMCache's own MP client (its shared-memory transfer context, in the reference venv)
across server restarts and odd layouts: a miss or a refusal is fine, wrong bytes never."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_lmcache_reference import REF_ENV, REF_VENV, reference_installed  # noqa: F401
from tiers_e2e import HERE, ServerProcess, fetch, start_server

from lmcache_tiers.testing.ports import free_ports
from lmcache_tiers.testing.threads import wait_until

MODEL = "ref-model"
TOKENS = [3] + [11] * 520  # two full chunks of 256, and some
LAYOUT = {"layers": 2, "slots": 256, "hidden": 64, "dtype": "bfloat16"}
# Generous: the answer to a command, the first one after importing torch and LMCache included.
CALL_DEADLINE_S = 120.0
# How long a request the server refuses (and so leaves unanswered) is waited for, rather than
# the driver's 3 s.  The wait cannot fail a correct server, whatever the load: no answer is
# what is expected, and the refusals are then counted, however late.  It bounds only how late
# a wrong answer may come and still be seen: the server answers in milliseconds.
REFUSED_WAIT_S = 1.0


class RefClient:
    """One LMCache client process; ``call`` sends a command and returns its answer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [str(REF_VENV / "bin" / "python"), str(HERE / "lmcache_ref_driver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **REF_ENV},
        )

    def connect(self, url: str) -> RefClient:
        """A fresh LMCache client on ``url``: the previous one and its mapping are closed."""
        answer = self.call("connect", url=url)
        assert answer == {"connected": url}, answer
        return self

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        # One answer line per command, so nothing is left buffered past it: the pipe being
        # readable means the answer (or the end) is there, and a client that hangs is killed
        # rather than read from until pytest's timeout.
        answered, _, _ = select.select([self.proc.stdout], [], [], CALL_DEADLINE_S)
        if not answered:
            self.proc.kill()
            raise AssertionError(f"the LMCache client did not answer {op} within {CALL_DEADLINE_S:g} s")
        line = self.proc.stdout.readline()
        assert line, f"the LMCache client exited ({self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class RefClients:
    """The module's LMCache client processes.  Starting one costs seconds of importing torch
    and LMCache, so a test takes an idle one and connects it to its own server afresh (the
    previous test's client and mapping are closed first): every test still runs on a client
    of its own."""

    def __init__(self) -> None:
        self.started: list[RefClient] = []
        self.idle: list[RefClient] = []

    def connect(self, url: str) -> RefClient:
        if not self.idle:
            self.started.append(RefClient())
            self.idle.append(self.started[-1])
        return self.idle.pop().connect(url)

    def give_back(self, client: RefClient) -> None:
        if client.proc.poll() is None:
            self.idle.append(client)

    def close(self) -> None:
        for client in self.started:
            if client.proc.poll() is None:
                client.close()


@pytest.fixture(scope="module")
def ref_clients() -> Iterator[RefClients]:
    clients = RefClients()
    try:
        yield clients
    finally:
        clients.close()


def serve(tmp_path: Path, name: str, **options: Any) -> ServerProcess:
    return start_server(tmp_path / name, l1_size_gb=0.25, frontends=[{"type": "lmcache_mp"}], **options)


def mp_failures(server: ServerProcess) -> dict[str, int]:
    """The LMCache frontend's failure counters, by reason, from the server's /status."""
    status = json.loads(fetch(f"{server.http_url}/status")[2])
    mp = next(entry for entry in status["frontends"] if entry["type"] == "lmcache_mp")
    failures: dict[str, int] = mp["failures"]
    return failures


def request(name: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "world_size": 1, "tokens": TOKENS, "end": 512, "request": name, **fields}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_restarted_server_never_honours_the_old_segment(
    tmp_path: Path, sig: int, ref_clients: RefClients
) -> None:
    """Same port and segment name after the restart: the client's calls on its old
    registration get misses or refusals, and once it registers again its chunks round-trip."""
    port, metrics_port = free_ports(2)
    options = {"port": port, "metrics_port": metrics_port, "l1_shm_name": f"ref_restart_{port}"}
    server = serve(tmp_path, "first", **options)
    client = ref_clients.connect(server.url)
    try:
        assert client.call("register", instance=1, model=MODEL, world_size=1, **LAYOUT)["pool_size"] > 0
        stored = client.call("store", instance=1, seed=5, **request("r1"))
        assert stored["committed"] is True and stored["slots"] == 2, stored
        server.stop(sig)
        # A killed server leaves its segment; the new one refuses to start on it until the
        # operator removes it (the client still maps the old file, which stays its own).
        Path("/dev/shm", options["l1_shm_name"]).unlink(missing_ok=True)
        server = serve(tmp_path, "second", **options)
        # The old registration: the new server does not know the instance, and refuses its
        # prepare_retrieve, commit_retrieve and prepare_store by leaving them unanswered.
        old = {"instance": 1, "timeout_s": REFUSED_WAIT_S}
        assert client.call("retrieve", **old, **request("r1")) == {"digests": None}
        assert "error" in client.call("store", **old, seed=9, **request("r2"))
        wait_until(
            lambda: mp_failures(server).get("mp_unregistered_instance") == 3,
            "the three requests of the old registration counted as refused",
        )
        # Registered again: a fresh mapping of the new segment, and the old chunks are gone.
        client.call("register", instance=1, model=MODEL, world_size=1, **LAYOUT)
        assert client.call("retrieve", instance=1, **request("r1")) == {"digests": None}
        stored = client.call("store", instance=1, seed=13, **request("r3"))
        assert stored["committed"] is True, stored
        got = client.call("retrieve", instance=1, **request("r3"))["digests"]
        assert got == [stored["digests"]["0"], stored["digests"]["1"]]
    finally:
        ref_clients.give_back(client)
        server.stop()


@pytest.mark.parametrize(
    ("chunk_size", "layout"),
    [
        (256, {"layers": 1, "slots": 256, "hidden": 3, "dtype": "float16"}),  # 3072 bytes: under 4096
        (64, {"layers": 3, "slots": 64, "hidden": 40, "dtype": "float32"}),  # 61440: not a multiple
        (512, {"layers": 1, "slots": 512, "hidden": 5, "dtype": "bfloat16"}),
    ],
)
def test_object_sizes_off_the_alignment_and_other_chunk_sizes(
    tmp_path: Path, chunk_size: int, layout: dict[str, Any], ref_clients: RefClients
) -> None:
    server = serve(tmp_path, "server", chunk_size=chunk_size)
    client = ref_clients.connect(server.url)
    tokens = [1] + [2] * (3 * chunk_size)
    try:
        client.call("register", instance=7, model=MODEL, world_size=1, **layout)
        fields = request("odd", tokens=tokens, end=3 * chunk_size)
        stored = client.call("store", instance=7, seed=1, **fields)
        assert stored["committed"] is True and stored["slots"] == 3, stored
        assert client.call("lookup", **fields, readers=1)["hits"] == 3
        got = client.call("retrieve", instance=7, **fields)["digests"]
        assert got == [stored["digests"][str(i)] for i in range(3)]
    finally:
        ref_clients.give_back(client)
        server.stop()


def test_world_size_two_with_one_rank_missing_hits_nothing(tmp_path: Path, ref_clients: RefClients) -> None:
    server = serve(tmp_path, "server")
    client = ref_clients.connect(server.url)
    try:
        client.call("register", instance=1, model=MODEL, world_size=2, **LAYOUT)
        fields = request("rank0", world_size=2)
        stored = client.call("store", instance=1, worker=0, seed=2, **fields)
        assert stored["committed"] is True, stored
        assert client.call("lookup", **fields, readers=1)["hits"] == 0
        assert client.call("retrieve", instance=1, worker=1, **fields) == {"digests": None}
    finally:
        ref_clients.give_back(client)
        server.stop()


def test_a_client_left_on_the_old_segment_cannot_store_garbage(
    tmp_path: Path, ref_clients: RefClients
) -> None:
    """Two client processes with the same instance id (fixed ids, as ``lmcache bench server``
    uses): after a restart, one registers again and the other does not.  The other's mapping
    is of the old server's segment, so whatever it copies never reaches the new server's
    extents: its store must not be made visible with the bytes the extents held."""
    port, metrics_port = free_ports(2)
    options = {"port": port, "metrics_port": metrics_port, "l1_shm_name": f"ref_stale_{port}"}
    server = serve(tmp_path, "first", **options)
    stale = ref_clients.connect(server.url)
    fresh = None
    try:
        stale.call("register", instance=1, model=MODEL, world_size=1, **LAYOUT)
        server.stop()
        server = serve(tmp_path, "second", **options)
        fresh = ref_clients.connect(server.url)
        fresh.call("register", instance=1, model=MODEL, world_size=1, **LAYOUT)
        stored = stale.call("store", instance=1, seed=21, **request("stale"))
        got = fresh.call("retrieve", instance=1, **request("stale"))["digests"]
        if got is not None:
            assert got == [stored["digests"]["0"], stored["digests"]["1"]], (stored, got)
        # Nor does it read this server's chunks through its old mapping.
        written = fresh.call("store", instance=1, seed=23, **request("fresh"))
        assert written["committed"] is True, written
        got = stale.call("retrieve", instance=1, **request("fresh"))["digests"]
        if got is not None:
            assert got == [written["digests"]["0"], written["digests"]["1"]], (written, got)
        # Registered again, it maps the new segment and round-trips.
        stale.call("register", instance=1, model=MODEL, world_size=1, **LAYOUT)
        got = stale.call("retrieve", instance=1, **request("fresh"))["digests"]
        assert got == [written["digests"]["0"], written["digests"]["1"]]
    finally:
        ref_clients.give_back(stale)
        if fresh is not None:
            ref_clients.give_back(fresh)
        server.stop()


def test_a_store_into_l1_full_of_read_locked_chunks_is_refused_and_counted(
    tmp_path: Path, ref_clients: RefClients
) -> None:
    """32 MiB chunks in a 256 MiB L1: six stored and held by a lookup's read locks leave no
    room for three more.  LMCache's client gets an answer (no slots: it skips its copy and
    commit), the refusal is counted, and neither request's bytes are disturbed."""
    server = serve(tmp_path, "server")
    client = ref_clients.connect(server.url)
    big = {"layers": 32, "slots": 256, "hidden": 1024, "dtype": "bfloat16"}
    held = request("held", tokens=[5] + [6] * (6 * 256), end=6 * 256)
    refused = request("refused", tokens=[8] + [9] * (3 * 256), end=3 * 256)
    try:
        client.call("register", instance=3, model=MODEL, world_size=1, **big)
        stored = client.call("store", instance=3, seed=4, **held)
        assert stored["committed"] is True and stored["slots"] == 6, stored
        assert client.call("lookup", **held, readers=1)["hits"] == 6  # read-locks all six
        answer = client.call("store", instance=3, seed=8, **refused)
        assert answer == {"slots": 0, "committed": False, "digests": {}}, answer
        failures = mp_failures(server)
        assert failures.get("mp_store_refused_l1_full", 0) >= 1, failures
        assert client.call("lookup", **refused, readers=1)["hits"] == 0
        got = client.call("retrieve", instance=3, **held)["digests"]
        assert got == [stored["digests"][str(i)] for i in range(6)]
    finally:
        ref_clients.give_back(client)
        server.stop()
