"""A set-up Mooncake refuses for what the config asks (memory it cannot allocate) fails
the adapter's start, naming the field, instead of being retried for good as if the
master did not answer."""

from __future__ import annotations

import logging
import threading
import urllib.parse
import urllib.request

import pytest
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import backend_of, config_for, eventually, open_adapter

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.testing.ports import free_port

#: more memory than any host can map: Mooncake's set-up cannot allocate it
UNALLOCATABLE = 1 << 60


def _connect_threads() -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("mooncake-") and "connect" in thread.name
    ]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"global_segment_size": UNALLOCATABLE},
            r"^0:mooncake_store: global_segment_size 1152921504606846976: ",
        ),
        ({"local_buffer_size": UNALLOCATABLE}, r"^0:mooncake_store: local_buffer_size 1152921504606846976: "),
    ],
)
def test_a_size_mooncake_cannot_allocate_fails_the_start_naming_its_field(
    mooncake_pool: LocalCluster, fields: dict[str, int], match: str
) -> None:
    before = set(_connect_threads())
    with pytest.raises(ConfigError, match=match):
        open_adapter(config_for(mooncake_pool, **fields))
    left = [thread for thread in _connect_threads() if thread not in before]
    for thread in left:
        thread.join(30)
    assert not [thread for thread in left if thread.is_alive()], "no more connection attempts"


def test_a_refusal_once_the_master_is_up_is_retried_and_shown(
    own_cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    # The master down while the adapter opens: the start cannot tell the config is
    # wrong; once it is up, the refusal is the warning's new cause.
    own_cluster.kill_master()
    adapter = open_adapter(
        config_for(own_cluster, global_segment_size=UNALLOCATABLE, operation_timeout_s=1.0)
    )
    try:
        connection = backend_of(adapter).connection
        with caplog.at_level(logging.WARNING, logger="lmcache_plugin_mooncake.client"):
            own_cluster.start_master()
            eventually(lambda: "global_segment_size" in connection.last_error, timeout=90, what="the refusal")
            eventually(
                lambda: any("global_segment_size" in record.getMessage() for record in caplog.records),
                what="the refusal's warning",
            )
        assert adapter.stats()["connected"] == 0
    finally:
        adapter.close()


def test_a_local_hostname_with_a_port_another_client_holds_fails_the_start_naming_it(
    mooncake_pool: LocalCluster,
) -> None:
    # With a port, the value is the segment's name as is: a second client under it is
    # refused with the -600 a segment Mooncake cannot allocate gets too.
    name = f"127.0.0.1:{free_port()}"
    first = open_adapter(config_for(mooncake_pool, local_hostname=name, global_segment_size="16MiB"))
    try:
        assert first.stats()["connected"] == 1
        with pytest.raises(ConfigError) as caught:
            open_adapter(config_for(mooncake_pool, local_hostname=name, global_segment_size="16MiB"))
        text = str(caught.value)
        assert text.startswith(
            f"0:mooncake_store: local_hostname '{name}': another Mooncake client holds this name"
        )
        assert "global_segment_size" not in text
        # The refused start left the holder's entry alone (Mooncake's own refusal drops it).
        entry = urllib.parse.quote(f"mooncake/rpc_meta/{name}", safe="")
        with urllib.request.urlopen(f"{mooncake_pool.metadata_server}?key={entry}", timeout=10) as answer:
            assert answer.status == 200
    finally:
        first.close()
    # A name no other client holds starts, with or without a port.
    for local_hostname in (f"127.0.0.1:{free_port()}", "banana"):
        adapter = open_adapter(
            config_for(mooncake_pool, local_hostname=local_hostname, global_segment_size="16MiB")
        )
        adapter.close()
