"""Serde transforms: what happens to an object's bytes on their way into and out of L2.

An adapter has a chain of serdes (fp8 quantization, compression, encryption ...), built
from its config's ``serde`` list.  On store the chain encodes first to last; on load it
decodes last to first.  Core applies the chain (:mod:`lmcache_tiers.l2.codec`), so L2
backends only ever see encoded payloads and never need to know which transforms are
configured.  The :class:`Serde` protocol itself lives in :mod:`lmcache_tiers.protocols`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from lmcache_tiers.config import SerdeSpec
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import TensorLayout
from lmcache_tiers.protocols import Serde
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.start_failures import create_component

__all__ = [
    "IdentitySerde",
    "Serde",
    "SerdeContext",
    "build_serde_chain",
    "decode_chain",
    "encode_chain",
    "serde_names",
    "stage_contexts",
]


@dataclass(frozen=True, slots=True)
class SerdeContext:
    """What a serde knows about the object it transforms, besides its bytes.

    ``key`` is the full object key (an encrypting serde binds it as associated data, so an
    object copied under another key fails to decrypt); ``size`` is the object's L1
    (decoded) size, the size the whole chain decodes back to; ``layout`` is the object's
    tensor layout when its writer gave one ("" otherwise, see :mod:`lmcache_tiers.layout`).
    The layout is known when an object is encoded, and only by the first serde of a chain
    (the one that receives the object's own bytes; later ones get ""); a serde that needs
    it to decode must carry it in its own encoding.

    ``record_layout`` is the layout the object's record states beside its payload (given
    to every stage, both ways; "" when unknown or not kept, as decoding in-memory stores):
    a loaded object gets that layout in L1, so an authenticating serde binds it -- a record
    whose stated layout was changed would otherwise make a later fp8 stage quantize its
    bytes as another dtype.

    ``chain`` names the stages of the chain this serde runs in, in encoding order (what
    a persistent record header states, :func:`serde_names`), and ``position`` is this
    stage's index in it; both ways, so an authenticating serde can bind them: a record
    whose stated chain was rewritten would otherwise hand out an inner stage's frame (of
    another adapter's chain under a shared key) as the object.  ``()`` when a caller
    runs a serde outside any chain.
    """

    key: ObjectKey
    size: int
    layout: str = ""
    record_layout: str = ""
    chain: tuple[str, ...] = ()
    position: int = 0

    @property
    def tensor_layout(self) -> TensorLayout | None:
        """The parsed layout, or None when it is unknown or unreadable."""
        return TensorLayout.parse_optional(self.layout)


class IdentitySerde:
    """The transform that changes nothing; an empty chain behaves the same way."""

    name = "identity"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview:
        return data

    def decode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview:
        return data


def build_serde_chain(
    specs: Sequence[SerdeSpec], registry: ComponentRegistry, adapter: str = "", path: str = ""
) -> list[Serde]:
    """Instantiate an adapter's resolved serde specs, in encoding order (``adapter``: its
    name, ``path``: where its config sits, for the line of a serde that fails to start)."""
    chain: list[Serde] = []
    for position, spec in enumerate(specs):
        component = registry.get(Kind.SERDE, spec.type)
        what = f"{adapter + ': ' if adapter else ''}serde[{position}] {component.origin}"
        where = f"{path}.serde[{position}]" if path else ""
        serde = create_component(component, spec.config, what=what, path=where)
        if not isinstance(serde, Serde):
            raise ConfigError(
                f"serde[{position}] {spec.type!r} built {type(serde).__name__}, which lacks "
                "name/encode/decode"
            )
        name = serde.name
        if not isinstance(name, str) or not name or "," in name:
            # Record headers join the chain's names with ',': a name holding one would make
            # two different chains look alike, and records of one decode with the other.
            raise ConfigError(
                f"serde[{position}] {spec.type!r} is named {name!r}; a serde name must be a "
                "non-empty string without ','"
            )
        chain.append(serde)
    return chain


def serde_names(chain: Sequence[Serde]) -> tuple[str, ...]:
    """The chain as recorded in persisted headers (identity stages are left out)."""
    return tuple(serde.name for serde in chain if not isinstance(serde, IdentitySerde))


def stage_contexts(chain: Sequence[Serde], context: SerdeContext) -> Iterator[tuple[Serde, SerdeContext]]:
    """Each non-identity stage of ``chain`` in encoding order, with the context it gets:
    the chain's recorded names and its own position in them, and ``context.layout`` for
    the first stage only (later ones receive bytes no layout describes)."""
    stages = [serde for serde in chain if not isinstance(serde, IdentitySerde)]
    names = serde_names(stages)
    for position, serde in enumerate(stages):
        layout = context.layout if position == 0 else ""
        yield serde, replace(context, layout=layout, chain=names, position=position)


def encode_chain(chain: Sequence[Serde], data: memoryview, context: SerdeContext) -> memoryview:
    """Run every encoder, first to last; only the first sees ``context.layout``."""
    for serde, stage_context in stage_contexts(chain, context):
        data = memoryview(serde.encode(data, stage_context)).cast("B")
    return data


def decode_chain(chain: Sequence[Serde], data: memoryview, context: SerdeContext) -> memoryview:
    """Run every decoder, last to first; ``context.size`` is the object's L1 size."""
    for serde, stage_context in reversed(list(stage_contexts(chain, context))):
        data = memoryview(serde.decode(data, stage_context)).cast("B")
    return data
