"""The pickle data path: chunks as pickled lists of CPU torch tensors, inline in the RPCs.

LMCache's clients use it when the server offers no shared-memory segment, or when they
cannot map it (another host, another IPC namespace).  Unpickling client bytes is running
client code, so it is off unless the front end's ``allow_pickle`` is set, and even then
only tensors are rebuilt: the unpickler resolves exactly the three names a pickled tensor
list refers to, and the nested storage blob is read with torch's ``weights_only`` loader.
That narrows what a client can make the server do, but torch's loader is a large surface:
trusted clients only.  torch is imported when this module is.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch._utils

from lmcache_tiers.plugin import TensorLayout

__all__ = ["PickleCodec"]


def _load_storage(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a pickled tensor list")
        return found


class PickleCodec:
    """Chunks to and from LMCache's pickled tensor lists."""

    def load(self, data: bytes, count: int, layout: TensorLayout) -> list[memoryview]:
        """The bytes of the ``count`` tensors pickled in ``data``, each of ``layout``;
        ValueError for anything else."""
        try:
            tensors = _TensorsOnly(io.BytesIO(data)).load()
        except Exception as exc:
            raise ValueError(f"pickled chunks cannot be read: {exc}") from None
        if not isinstance(tensors, list) or len(tensors) != count:
            got = f"{len(tensors)} items" if isinstance(tensors, list) else type(tensors).__name__
            raise ValueError(f"pickled chunks: expected a list of {count} tensors, got {got}")
        views = []
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"pickled chunks: {type(tensor).__name__} is not a tensor")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype != layout.dtype or tuple(tensor.shape) != layout.shape or tensor.device.type != "cpu":
                raise ValueError(
                    f"pickled chunk {dtype}{list(tensor.shape)} on {tensor.device} is not the registered "
                    f"layout {layout.format()} on cpu"
                )
            try:
                views.append(tensor.contiguous().view(torch.uint8).reshape(-1).numpy().data)
            except Exception as exc:  # e.g. a tensor with the negative or conjugate bit set
                raise ValueError(f"pickled chunk cannot be read as bytes: {exc}") from None
        return views

    def dump(self, chunks: Sequence[bytes | bytearray | memoryview], layout: TensorLayout) -> bytes:
        """``chunks`` (each the bytes of one object of ``layout``) as a pickled tensor list."""
        dtype = getattr(torch, layout.dtype)
        tensors = [
            torch.frombuffer(bytearray(chunk) if isinstance(chunk, bytes) else chunk, dtype=dtype).view(
                layout.shape
            )
            for chunk in chunks
        ]
        return pickle.dumps(tensors, protocol=4)
