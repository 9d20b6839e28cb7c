"""The operations of LMCache's MP protocol, by name, and what this front end answers.

Served: everything ``lmcache bench server --mode cpu`` and vLLM's LMCache MP connector use
in engine-driven mode (see :data:`SERVED`).  Answered without effect where LMCache's
server answers too: ``unregister_kv_cache`` and ``report_block_allocation`` (void).  Not
served, and not answered (as LMCache's server does not answer what it cannot serve):
LMCache-driven transfers (``register_kv_cache``, ``store``, ``retrieve``: the server would
have to map the engine's KV memory, CUDA IPC or per-layer segments), the Q ring, CacheBlend,
P2P and the KV-event stream; each is logged with its ids and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from lmcache_plugin_lmcache_mp.base import Deferred, RequestRefused, Shared
from lmcache_plugin_lmcache_mp.lookups import Lookups
from lmcache_plugin_lmcache_mp.state import MAX_MAPPING_CONNECTIONS, Instance
from lmcache_plugin_lmcache_mp.transfers import Transfers
from lmcache_plugin_lmcache_mp.wire import RegisterPayload, RegisterReply
from lmcache_tiers.plugin import BurstLog, KeyValidationError, ObjectKey, TensorLayout, printable

logger = logging.getLogger(__name__)

#: workers registered at once.  Instance ids are the clients' choice and one that never
#: pings stays for worker_registration_grace_s: without a bound, registrations could grow
#: the table (and every lookup's search of it) at will.  A registration beyond it is refused.
MAX_INSTANCES = 1024

_Q_RING = "the experimental Q ring is not supported"
_BLEND = "CacheBlend is not supported"

#: (connection, instance id) pairs whose ping was answered false, so that the next one
#: answers true; beyond it the oldest is forgotten (it may be answered false once more)
MAX_REREGISTRATION_ASKS = 1024
_P2P = "P2P transfers between servers are not supported"

#: operations of LMCache's protocol this server does not serve, with what the log line says
NOT_SERVED: dict[str, str] = {
    "register_kv_cache": "LMCache-driven transfers need the server to map the engine's KV memory "
    "(CUDA IPC needs an accelerator; per-layer CPU segments are not supported): use engine-driven "
    "transfers (lmcache bench server --transfer-mode engine_driven; vLLM's LMCache MP connector in "
    "engine-driven mode)",
    "store": "LMCache-driven store (after register_kv_cache) is not supported",
    "retrieve": "LMCache-driven retrieve (after register_kv_cache) is not supported",
    "register_q_cache": _Q_RING,
    "unregister_q_cache": _Q_RING,
    "store_q": _Q_RING,
    "cb_register_rope": _BLEND,
    "cb_unregister_rope": _BLEND,
    "cb_retrieve_pre_computed": _BLEND,
    "cb_unified_lookup": _BLEND,
    "cb_protocol_handshake": _BLEND,
    "cb_reorder_plan": _BLEND,
    "p2p_lookup_and_lock": _P2P,
    "p2p_query_lookup_results": _P2P,
    "p2p_unlock_objects": _P2P,
    "subscribe_kv_events": "the KV-event stream is not supported (get_experimental lists no feature)",
    "server_module_call": "server modules are not supported",
}


#: operations whose handler is told the client's connection (``peer``): registrations,
#: transfers, whose commit finishes only what a prepare on the same connection began, and
#: pings, which ask a connection that did not register its instance to register it
BY_CONNECTION = frozenset(
    {
        "ping",
        "register_kv_cache_engine_driven_context",
        "unregister_kv_cache_engine_driven_context",
        "prepare_store",
        "commit_store",
        "prepare_retrieve",
        "commit_retrieve",
    }
)


class Handlers:
    """Operation name -> handler, over the state in :class:`Shared`."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared
        self.lookups = Lookups(shared)
        self.transfers = Transfers(shared, self.lookups)
        # Instance ids are the clients' choice: lines about them are burst-limited.
        self._unknown_unregisters = BurstLog(logger, "mp_unregister_unknown")
        self._reaped = BurstLog(logger, "mp_instance_reaped")
        self._stale_unregisters = BurstLog(logger, "mp_stale_unregister")
        self._reregistration_asks = BurstLog(logger, "mp_ping_asks_reregistration")
        self._forgotten_registrations = BurstLog(logger, "mp_registrations_forgotten")
        self._asked_to_register: dict[tuple[bytes, int], None] = {}
        self.table: dict[str, Callable[..., Any]] = {
            "get_chunk_size": lambda: shared.chunk_size,
            "noop": lambda: "OK",
            "get_experimental": lambda: [],
            "ping": self.ping,
            "register_kv_cache_engine_driven_context": self.register,
            "unregister_kv_cache_engine_driven_context": self.unregister,
            "unregister_kv_cache": lambda instance_id: None,  # nothing is ever registered so
            "report_block_allocation": lambda instance_id, model_name, records: None,
            "lookup": self.lookups.lookup,
            "query_prefetch_status": self.lookups.query_prefetch_status,
            "wait_prefetch_status": self.lookups.wait_prefetch_status,
            "free_lookup_locks": self.lookups.free_lookup_locks,
            "end_session": self.lookups.end_session,
            "prepare_store": self.transfers.prepare_store,
            "commit_store": self.transfers.commit_store,
            "prepare_retrieve": self.transfers.prepare_retrieve,
            "commit_retrieve": self.transfers.commit_retrieve,
            "clear": self.clear,
        }

    def dispatch(self, name: str, args: list[Any], peer: bytes) -> Any:
        """Run operation ``name``; ``peer`` names the client's connection (its ZeroMQ
        identity and socket, ``MPServer.connection``), which (un)registrations and
        transfers record and check."""
        if name in BY_CONNECTION:
            return self.table[name](*args, peer=peer)
        return self.table[name](*args)

    # -- liveness and registration ---------------------------------------------------------

    def ping(self, instance_id: int | None, *, peer: bytes) -> Any:
        instance = None if instance_id is None else self.shared.instances.get(instance_id)
        if instance is not None:
            instance.last_seen = time.monotonic()
            instance.pinged = True
        if instance_id is None or (instance is not None and self._serves_transfers(instance, peer)):
            return True
        forgotten = instance is not None and peer in instance.forgotten
        return not self._ask_to_register(instance_id, peer, forgotten)

    def _serves_transfers(self, instance: Instance, peer: bytes) -> bool:
        """Whether the connection's transfers of a known instance are served: pickled
        chunks map no segment, so any connection's are; with shared memory, only those of
        a connection that registered the instance (see Transfers._maps_segment).  A false
        ping costs LMCache's worker a heartbeat in degraded mode (in-flight retrieves
        failed, stores dropped), worth it only when its transfers are refused anyway."""
        return self.shared.shm is None or instance.maps_segment(peer)

    def _ask_to_register(self, instance_id: int, peer: bytes, forgotten: bool) -> bool:
        """Whether to answer false to a ping naming an instance its connection did not
        register with this server process (a client of a restarted server, reconnected by
        ZeroMQ, or an instance reaped or never registered): once per connection and
        instance.  LMCache's vLLM worker registers again -- and maps this server's segment
        -- only on its heartbeat's unhealthy-to-healthy edge, which a restart quicker than
        its ping timeout never shows; until it does, its transfers are refused (with shared
        memory; an unknown instance's in either mode)."""
        asked = (peer, instance_id)
        if asked in self._asked_to_register:
            return False  # answered false before: this true is the edge that re-registers
        self._asked_to_register[asked] = None
        while len(self._asked_to_register) > MAX_REREGISTRATION_ASKS:
            del self._asked_to_register[next(iter(self._asked_to_register))]
        self.shared.stats.failure("mp_ping_asks_reregistration")
        cause = (
            f"its registration was forgotten, the least recently used of over {MAX_MAPPING_CONNECTIONS}"
            if forgotten
            else "a client of a restarted server, or an instance reaped"
        )
        self._reregistration_asks.event(
            1,
            f"ping of instance {instance_id} answered false once: this server process knows of no "
            f"registration of it by its connection ({cause}), so LMCache's heartbeat registers it again",
        )
        return True

    def register(self, payload: RegisterPayload, *, peer: bytes) -> Any:
        shared = self.shared
        now = time.monotonic()
        existing = shared.instances.get(payload.instance_id)
        if existing is not None and _same_registration(existing, payload, shared.chunk_size):
            existing.last_seen = now  # a repeat only refreshes liveness, as in LMCache
            self._note_mapped(existing, peer)  # it maps the segment this reply names
            self._asked_to_register.pop((peer, payload.instance_id), None)
            if existing.peer != peer:
                # A restarted client process: the registration is its own from now on, and
                # the earlier process's unregister (maybe still on its way) leaves it alone.
                logger.info(
                    "instance %d registers again from another connection (a restarted client): "
                    "the registration is kept, and from now on only that connection may unregister it",
                    payload.instance_id,
                )
                existing.peer = peer
            return self._register_reply()
        if existing is None and len(shared.instances) >= MAX_INSTANCES:
            raise RequestRefused(
                "mp_too_many_instances",
                f"{len(shared.instances)} instances registered, the most this server keeps; "
                f"instance {payload.instance_id} is not (unregister or let silent ones be reaped)",
            )
        layout = _layout_of(payload, shared.chunk_size)
        capacity = shared.storage.l1.capacity_bytes
        if layout.nbytes > capacity:
            raise RequestRefused(
                "mp_bad_request",
                f"one chunk of layout {layout.format()} ({layout.nbytes} bytes) exceeds L1 ({capacity})",
            )
        if existing is not None:
            # Another model, world size or layout under a registered id: a restarted client
            # (``lmcache bench server`` registers fixed ids).  Keeping the first registration
            # would hand the new one slots of the old layout and hide its model from lookups.
            logger.warning(
                "instance %d registers again with another model, world size or layout (%s, %d, "
                "was %s, %d, %s): its first registration is replaced",
                payload.instance_id,
                printable(payload.model_name),
                payload.world_size,
                printable(existing.model_name),
                existing.world_size,
                existing.layout_text,
            )
            # Only this connection's transfers go: another process sending the same id may
            # be copying into or out of its slots.  Its transfers keep the layout they were
            # prepared with (their L1 objects record it), so its commits stay right.
            self._drop(payload.instance_id, peer)
        self._asked_to_register.pop((peer, payload.instance_id), None)
        shared.instances[payload.instance_id] = Instance(
            payload.instance_id, payload.model_name, payload.world_size, layout, now, now, peer
        )
        logger.info(
            "registered instance %d: model %s, world size %d, chunks of %s (%d bytes), %s",
            payload.instance_id,
            printable(payload.model_name),
            payload.world_size,
            layout.format(),
            layout.nbytes,
            "shared memory" if shared.shm is not None else "pickled chunks",
        )
        return self._register_reply()

    def _note_mapped(self, instance: Instance, peer: bytes) -> None:
        """Record ``peer``'s registration of ``instance``; count and log the connections
        forgotten to make room (their transfers are refused until they register again)."""
        forgotten = instance.note_mapped(peer)
        if forgotten:
            self.shared.stats.failure("mp_registrations_forgotten", forgotten)
            self._forgotten_registrations.event(
                forgotten,
                f"connections that registered instance {instance.instance_id} forgotten: more than "
                f"{MAX_MAPPING_CONNECTIONS} registered it, and these were the least recently used "
                "(their transfers are refused until they register again)",
            )

    def _register_reply(self) -> RegisterReply:
        name, size = self.shared.shm if self.shared.shm is not None else ("", 0)
        return RegisterReply(shm_name=name, pool_size=size)

    def unregister(self, instance_id: int, *, peer: bytes) -> Any:
        """The client's unregister: only the connection that made the registration in force
        ends it.  Instance ids are fixed per deployment (``lmcache bench server``, vLLM's
        workers), so an earlier client process may unregister after a restarted one
        registered the same id again: that would take the live client's layout away and
        abort its stores.  LMCache's client registers and unregisters on one connection."""
        instance = self.shared.instances.get(instance_id)
        if instance is not None and instance.peer != peer:
            # The registration stays, but what this connection itself prepared goes, as at
            # any unregister: its client has ended its copies (LMCache's unregisters after
            # its gathers and commits), and left pending its read locks would wait for the
            # lock TTL, its reservations for the write TTL, and their fences for a commit
            # that never comes.
            locks, reservations = self.transfers.drop_instance(instance_id, peer, copies_ended=True)
            self.shared.stats.failure("mp_stale_unregister")
            self._stale_unregisters.event(
                1,
                f"unregisters ignored: they came from another connection than the registration in "
                f"force (instance {instance_id}: an earlier client process after a restarted one "
                "registered it again, or a client whose connection was re-established; such a "
                f"registration goes when it falls silent); that connection's own {locks} read "
                f"locks released and {reservations} unfinished stores aborted",
            )
            return None
        if instance is None:
            # Not registered (reaped, or never with this server process): answered void and
            # counted below.  What this connection prepared under the id still goes: a
            # reaped instance's stores are left pending for a client that may be stalled
            # before its copy, and its unregister says its copies have ended.
            self.transfers.drop_instance(instance_id, peer, copies_ended=True)
        self._drop(instance_id, peer, copies_ended=True)
        return None

    def _drop(self, instance_id: int, peer: bytes | None = None, *, copies_ended: bool = False) -> None:
        """Forget an instance and give back what its transfers hold (with ``peer``, only
        the transfers of that connection; ``copies_ended``, its unregister: see
        ``Transfers.drop_instance``)."""
        instance = self.shared.instances.pop(instance_id, None)
        if instance is None:
            # Answered void, as by LMCache's server, but counted: a client unregistering
            # what this server never registered (or reaped) was likely served by another
            # server process, or lost its registration without noticing.
            self.shared.stats.failure("mp_unregister_unknown")
            self._unknown_unregisters.warn(
                "unregister",
                "unregister of instance %d, which is not registered (counted as mp_unregister_unknown)",
                instance_id,
            )
            return
        locks, reservations = self.transfers.drop_instance(instance_id, peer, copies_ended=copies_ended)
        if peer is None:
            # Reaped for its silence: its stores are left to their write deadline (a silent
            # client may be one stalled before its copy), so none is aborted here.
            logger.info(
                "unregistered instance %d (%d read locks released, unfinished stores left to "
                "their write deadline)",
                instance_id,
                locks,
            )
            return
        logger.info(
            "unregistered instance %d (%d read locks released, %d unfinished stores aborted)",
            instance_id,
            locks,
            reservations,
        )

    def reap(self, now: float) -> None:
        """Unregister instances silent for longer than LMCache's reaper allows."""
        config = self.shared.config
        for instance in list(self.shared.instances.values()):
            limit = config.worker_reap_timeout_s if instance.pinged else config.worker_registration_grace_s
            if now - instance.last_seen > limit:
                self.shared.stats.failure("mp_instance_reaped")
                self._reaped.event(
                    1, f"silent instances unregistered (instance {instance.instance_id}, limit {limit:g}s)"
                )
                self._drop(instance.instance_id)

    # -- maintenance -------------------------------------------------------------------------

    def clear(self, force: bool) -> Any:
        storage = self.shared.storage

        def work() -> Callable[[], Any]:
            cleared = storage.clear(force=force)
            logger.info("clear (force=%s): %d objects removed from L1", force, cleared)
            return lambda: None

        return Deferred(work)

    def sweep(self, now: float) -> None:
        self.lookups.sweep(now)
        self.transfers.sweep(now)
        self.reap(now)
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        stats = self.shared.stats
        held, pending = self.lookups.gauges()
        stats.locked_keys = held + self.transfers.reads.keys_count()
        stats.pending_prefetches = pending
        stats.reserved_stores = self.transfers.writes.keys_count()
        stats.sessions = len(self.shared.instances)

    def release_everything(self) -> None:
        """Shutdown: give back every lock and reservation the clients still hold."""
        locks = self.lookups.release_everything()
        transfer_locks, reservations = self.transfers.release_everything()
        self.shared.stats.released_at_stop_locks = locks + transfer_locks
        self.shared.stats.released_at_stop_reservations = reservations


def _same_registration(instance: Instance, payload: RegisterPayload, chunk_size: int) -> bool:
    if (instance.model_name, instance.world_size) != (payload.model_name, payload.world_size):
        return False
    try:
        return _layout_of(payload, chunk_size) == instance.layout
    except RequestRefused:
        return False


def _layout_of(payload: RegisterPayload, chunk_size: int) -> TensorLayout:
    """The tensor one chunk object is: ``[2, layers, slots, hidden]`` (K and V planes), or
    ``[layers, slots, hidden]`` for single-plane formats (MLA), of ``dtype_str``."""
    slots = payload.num_physical_slots if payload.num_physical_slots is not None else chunk_size
    dims = {
        "num_layers": payload.num_layers,
        "hidden_dim_size": payload.hidden_dim_size,
        "num_physical_slots": slots,
        "block_size": payload.block_size,
    }
    for name, value in dims.items():
        if value <= 0:
            raise RequestRefused("mp_bad_request", f"{name} must be positive, got {value}")
    if not 0 < payload.world_size < 256:
        raise RequestRefused("mp_bad_request", f"world_size {payload.world_size} is outside 1..255")
    try:
        ObjectKey(payload.model_name, 0, b"\0")  # the name must make valid keys
    except KeyValidationError as exc:
        raise RequestRefused("mp_bad_request", str(exc)) from None
    planes = [] if payload.use_mla else [2]
    try:
        return TensorLayout(payload.dtype_str, (*planes, payload.num_layers, slots, payload.hidden_dim_size))
    except ValueError as exc:  # not a dtype name torch has
        raise RequestRefused("mp_bad_request", f"dtype_str: {exc}") from None
