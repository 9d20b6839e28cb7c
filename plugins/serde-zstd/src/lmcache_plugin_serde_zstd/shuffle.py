"""Byte shuffle: the byte planes of an array of fixed-size elements.

``shuffle_into`` writes byte 0 of every element, then byte 1 of every element, and so on;
a tail shorter than one element is copied unchanged after the planes.  For bf16 KV this
puts the sign-and-exponent bytes (few distinct values) in one run and the mantissa bytes
in another, which an entropy coder compresses far better than the interleaved bytes.
Elements are read little-endian whatever the host, so a shuffled frame written on one
machine unshuffles on any other.
"""

from __future__ import annotations

import numpy as np

__all__ = ["shuffle_into", "unshuffle_into"]


def _check(source: memoryview, target: memoryview, element_size: int) -> int:
    if source.nbytes != target.nbytes:
        raise ValueError(f"shuffle of {source.nbytes} bytes into a buffer of {target.nbytes}")
    if element_size < 2:
        raise ValueError(f"element size {element_size} has nothing to shuffle")
    return source.nbytes - source.nbytes % element_size


def shuffle_into(source: memoryview, target: memoryview, element_size: int) -> None:
    """Write the byte planes of ``source`` into the writable ``target`` (same length)."""
    whole = _check(source, target, element_size)
    planes = np.frombuffer(target[:whole], dtype=np.uint8).reshape(element_size, -1)
    if element_size == 2:
        # Two integer passes over uint16 run several times faster than a strided copy.
        pairs = np.frombuffer(source[:whole], dtype="<u2")
        np.bitwise_and(pairs, 0xFF, out=planes[0], casting="unsafe")
        np.right_shift(pairs, 8, out=planes[1], casting="unsafe")
    else:
        elements = np.frombuffer(source[:whole], dtype=np.uint8).reshape(-1, element_size)
        for index in range(element_size):
            planes[index] = elements[:, index]
    target[whole:] = source[whole:]


def unshuffle_into(source: memoryview, target: memoryview, element_size: int) -> None:
    """Inverse of :func:`shuffle_into`."""
    whole = _check(source, target, element_size)
    planes = np.frombuffer(source[:whole], dtype=np.uint8).reshape(element_size, -1)
    if element_size == 2:
        pairs = np.frombuffer(target[:whole], dtype="<u2")
        np.left_shift(planes[1], 8, out=pairs, dtype="<u2")
        np.bitwise_or(pairs, planes[0], out=pairs)
    else:
        elements = np.frombuffer(target[:whole], dtype=np.uint8).reshape(-1, element_size)
        for index in range(element_size):
            elements[:, index] = planes[index]
    target[whole:] = source[whole:]
