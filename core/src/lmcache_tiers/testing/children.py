"""Processes a test starts to play a server's clients (a writer mapping the arena, a relay
in front of the server): started with their output piped, read and told one line at a
time, and ended -- killed, reaped, pipes closed -- however the test ends (the ``processes``
fixture holds them for a test)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = [
    "FILE_MAPPER",
    "TCP_RELAY",
    "end",
    "ended_at_exit",
    "line_of",
    "processes",
    "says",
    "start_script",
    "tell",
]

#: relays every connection to 127.0.0.1:argv[1] from a port of its own, which it prints:
#: the server sees the relay's socket, never the client behind it (its process unnamed)
TCP_RELAY = """
import socket, sys, threading
target = int(sys.argv[1])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
def pump(source, sink):
    while data := source.recv(65536):
        sink.sendall(data)
    sink.shutdown(socket.SHUT_WR)
while True:
    near, _ = listener.accept()
    far = socket.create_connection(("127.0.0.1", target))
    for a, b in ((near, far), (far, near)):
        threading.Thread(target=pump, args=(a, b), daemon=True).start()
"""

#: maps the file argv[1] (a server's arena, say) as a client does, says "mapped", then waits
#: for its stdin to end (``start_script`` pipes it) or to be killed
FILE_MAPPER = """
import mmap, sys
with open(sys.argv[1], "r+b") as f:
    mapped = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
sys.stdin.read()
"""


def start_script(
    script: str, *args: str, started: list[subprocess.Popen[str]] | None = None
) -> subprocess.Popen[str]:
    """``python -c script args`` with stdin and stdout piped (text), added to ``started``."""
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if started is not None:
        started.append(process)
    return process


def line_of(process: subprocess.Popen[str]) -> str:
    """The next line ``process`` prints, stripped (waits for it)."""
    assert process.stdout is not None
    return process.stdout.readline().strip()


def says(process: subprocess.Popen[str], word: str) -> None:
    """Wait for ``process`` to print ``word`` as its next line; AssertionError otherwise."""
    assert line_of(process) == word


def tell(process: subprocess.Popen[str], word: str) -> None:
    """Send ``word`` to ``process`` as one line."""
    assert process.stdin is not None
    process.stdin.write(word + "\n")
    process.stdin.flush()


def end(process: subprocess.Popen[str]) -> None:
    """Kill and reap ``process`` and close its pipes (again, harmlessly, if ended already)."""
    process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


@contextmanager
def ended_at_exit() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to add started processes to; each is ended when the block exits."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for process in started:
            end(process)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """The list a test adds the processes it starts to (``start_script(...,
    started=processes)``); each is ended once the test ends.  Import it into a conftest
    to use it."""
    with ended_at_exit() as started:
        yield started
