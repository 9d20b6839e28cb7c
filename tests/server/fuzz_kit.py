"""Hypothesis pieces the fuzz tests of every front end share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq
from hypothesis import strategies as st

#: any msgpack document: what a client could put where a request field goes
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def mutate(draw: st.DrawFn, frame: bytearray) -> None:
    """One random edit of ``frame`` in place: truncate, flip a byte, insert or delete."""
    action = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
    position = draw(st.integers(0, max(0, len(frame) - 1)))
    if action == "truncate":
        del frame[position:]
    elif action == "flip" and frame:
        frame[position] ^= draw(st.integers(1, 255))
    elif action == "insert":
        frame[position:position] = draw(st.binary(min_size=1, max_size=8))
    elif frame:
        del frame[position]


@contextlib.contextmanager
def connected_dealer(url: str) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER socket connected to ``url``, closed (without lingering) afterwards."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close(0)
        context.term()
