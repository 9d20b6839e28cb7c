"""L2 adapter ``mock``: objects kept in this process's memory."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from lmcache_tiers.plugin import FieldError, KindRegistry, L2AdapterConfig, SizeGiB, check_size_gib, hookimpl


class MockConfig(L2AdapterConfig):
    """In-memory L2 adapter for tests and benchmarks.

    Stores fail once ``max_size_gb`` is full (refused by core, counted), so per-adapter
    eviction (``eviction``) has something to do.  Bandwidth and latency are simulated by
    sleeping in each backend call (a store or load of N bytes takes
    ``latency_s + N / bandwidth_bytes_per_s``).
    Adapters configured with the same ``namespace`` share their objects within one
    process, which lets tests close an adapter and open a new one as if after a restart.
    As after a restart of a record store, objects stored under another serde chain than
    the adapter's are misses it keeps, counted (``serde_chain_mismatch``) and logged.
    Objects are kept in a memory pool of ``max_size_gb`` per namespace (address space,
    faulted in as it is first written, or at start with ``prefault``) whose pages are
    reused after deletes.
    """

    #: LMCache's persist_enabled (true by default there) asks for records found again after
    #: a restart; these are gone with the process, so no value of it is true here
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "persist_enabled": "mock keeps its objects in this process's memory: none outlives a "
        "restart of the server, so there is nothing to persist (leave the field out)",
    }

    max_size_gb: Annotated[
        SizeGiB,
        msgspec.Meta(gt=0.0, description="Capacity in GiB; a store that does not fit fails for that key."),
    ] = 1.0
    bandwidth_bytes_per_s: Annotated[
        int, msgspec.Meta(ge=0, description="Simulated transfer rate of stores and loads; 0 = unlimited.")
    ] = 0
    latency_s: Annotated[
        float,
        msgspec.Meta(
            ge=0.0, le=60.0, description="Simulated latency added to every backend call, in seconds."
        ),
    ] = 0.0
    prefault: Annotated[
        bool,
        msgspec.Meta(
            description=(
                "Fault in the whole memory pool (max_size_gb) when the adapter starts, so that "
                "stores never pay for first touches of fresh pages; for benchmarks."
            )
        ),
    ] = False
    mock_bandwidth_gb: Annotated[
        Annotated[SizeGiB, msgspec.Meta(gt=0.0)] | None,
        msgspec.Meta(
            description="LMCache's mock field: the simulated rate in GiB per second (1 = 2**30 "
            "bytes/s, as LMCache counts it); sets bandwidth_bytes_per_s. null: that field alone."
        ),
    ] = None
    namespace: Annotated[
        str | None,
        msgspec.Meta(
            description="Mock adapters with the same namespace share their objects for the process lifetime."
        ),
    ] = None

    def __post_init__(self) -> None:
        self._fold_lmcache_bandwidth()
        check_size_gib("max_size_gb", self.max_size_gb)
        if self.namespace is not None and not 0 < len(self.namespace) <= 128:
            raise FieldError("namespace", "namespace must be 1..128 characters long")

    def _fold_lmcache_bandwidth(self) -> None:
        """Set bandwidth_bytes_per_s from LMCache's mock_bandwidth_gb (GiB/s), so the backend
        reads one field; both given must agree (a printed config gives both)."""
        if self.mock_bandwidth_gb is None:
            return
        rate = int(self.mock_bandwidth_gb * (1 << 30))
        if rate == 0:
            # 0 bytes/s is "unlimited": the slowest rate asked for must not become the fastest.
            raise FieldError(
                "mock_bandwidth_gb",
                f"mock_bandwidth_gb {self.mock_bandwidth_gb:g} GiB/s is under 1 byte/s; the least is "
                f"{1 / (1 << 30):g} GiB/s",
            )
        if self.bandwidth_bytes_per_s not in (0, rate):
            raise FieldError(
                "mock_bandwidth_gb",
                f"mock_bandwidth_gb {self.mock_bandwidth_gb:g} GiB/s is {rate} bytes/s, but "
                f"bandwidth_bytes_per_s is {self.bandwidth_bytes_per_s}; give one of the two",
            )
        msgspec.structs.force_setattr(self, "bandwidth_bytes_per_s", rate)


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("mock", "lmcache_plugin_mock.backend:MockBackend", MockConfig)
