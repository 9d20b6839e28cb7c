"""Start-up choices and checks of the NIXL runtime: the module that provides OBJ is picked
without any setting, and an AZURE_BLOB service that cannot be reached stops the server
with one line instead of failing every store later."""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_obj_backend
from lmcache_plugin_nixl.availability import azure_blob_endpoint, check_remote_endpoint, obj_endpoint
from nixl_helpers import serve_refusal
from test_obj_backend import HERE, s3_endpoint  # noqa: F401 - the S3 server fixture

from lmcache_tiers.config import FieldError
from lmcache_tiers.l2.preflight import direct_io_refusal
from lmcache_tiers.testing.ports import free_port

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]


def unset_module_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "LMCACHE_NIXL_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return env


def test_obj_plugin_loads_with_no_module_setting() -> None:
    if importlib.util.find_spec("nixl_cu12") is None:
        pytest.skip(
            "nixl-cu12 is not installed: no NIXL wheel here has an OBJ plugin that loads without CUDA"
        )
    probe = (
        "from lmcache_plugin_nixl.runtime import NixlRuntime\n"
        "runtime = NixlRuntime.shared()\n"
        "runtime.agent.agent.getPluginParams('OBJ')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=unset_module_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_obj_round_trip_with_no_module_setting(
    s3_endpoint: str,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The OBJ test's child process, with LMCACHE_NIXL_MODULE left unset.
    monkeypatch.setattr(test_obj_backend, "child_env", unset_module_env)
    test_obj_backend.test_obj_pool_round_trip_exhaustion_and_reuse(s3_endpoint)


def test_azure_blob_endpoint_comes_from_account_url_or_connection_string() -> None:
    assert azure_blob_endpoint({"account_url": "https://acct.blob.core.windows.net"}) == (
        "https://acct.blob.core.windows.net",
        "account_url",
    )
    azurite = "DefaultEndpointsProtocol=http;AccountName=dev;AccountKey=k==;BlobEndpoint=http://127.0.0.1:10000/dev;"
    assert azure_blob_endpoint({"connection_string": azurite}) == (
        "http://127.0.0.1:10000/dev",
        "connection_string",
    )
    assert azure_blob_endpoint(
        {"connection_string": "AccountName=acct;EndpointSuffix=core.chinacloudapi.cn"}
    ) == (
        "https://acct.blob.core.chinacloudapi.cn",
        "connection_string",
    )


def test_remote_endpoint_probe() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_remote_endpoint("AZURE_BLOB", {"account_url": f"http://127.0.0.1:{port}/acct"})
    closed = free_port()
    with pytest.raises(
        FieldError, match=rf"127\.0\.0\.1:{closed}\) cannot be reached: .*backend_params\.account_url"
    ) as caught:
        check_remote_endpoint("AZURE_BLOB", {"account_url": f"http://127.0.0.1:{closed}"})
    assert caught.value.field == "backend_params.account_url", "start-up names the adapter and the path"
    with pytest.raises(FieldError, match="not a URL with a host name") as caught:
        check_remote_endpoint("AZURE_BLOB", {"account_url": "acct.blob.core.windows.net"})
    assert caught.value.field == "backend_params.account_url"
    check_remote_endpoint("POSIX", {})  # only remote stores are probed


def test_obj_needs_a_bucket_and_a_reachable_endpoint_override() -> None:
    """NIXL creates an OBJ backend without contacting S3: an unreachable endpoint would
    fail every store only after the SDK's retries (tens of seconds each), and a missing
    bucket fails creation with a bare NIXL_ERR_BACKEND."""
    with pytest.raises(FieldError, match=r"backend_params\.bucket is required for the OBJ backend") as caught:
        check_remote_endpoint("OBJ", {"endpoint_override": "http://127.0.0.1:1"}, environ={})
    assert caught.value.field == "backend_params.bucket", "start-up names the adapter and the key's path"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        check_remote_endpoint("OBJ", {"bucket": "b", "endpoint_override": f"http://127.0.0.1:{port}"})
        # a bare host:port takes the scheme parameter
        check_remote_endpoint(
            "OBJ", {"bucket": "b", "endpoint_override": f"127.0.0.1:{port}", "scheme": "http"}
        )
        check_remote_endpoint(
            "OBJ", {"endpoint_override": f"127.0.0.1:{port}"}, environ={"AWS_DEFAULT_BUCKET": "b"}
        )
    closed = free_port()
    with pytest.raises(
        FieldError,
        match=rf"OBJ endpoint http://127\.0\.0\.1:{closed} \(127\.0\.0\.1:{closed}\) cannot be reached: "
        r".*backend_params\.endpoint_override",
    ) as caught:
        check_remote_endpoint("OBJ", {"bucket": "b", "endpoint_override": f"http://127.0.0.1:{closed}"})
    assert caught.value.field == "backend_params.endpoint_override", "start-up names the adapter and the path"


def test_obj_without_an_endpoint_override_is_probed_at_aws_own_endpoint_of_its_region() -> None:
    """Unprobed, a server with no route to AWS started and failed each store after about
    26 s of the SDK's retries with a bare NIXL_ERR_BACKEND."""
    assert obj_endpoint({"bucket": "b"}, environ={}) == ("https://s3.us-east-1.amazonaws.com", "region")
    assert obj_endpoint({"bucket": "b"}, environ={"AWS_DEFAULT_REGION": "eu-west-1"})[0] == (
        "https://s3.eu-west-1.amazonaws.com"
    )
    environ = {"AWS_REGION": "ap-south-1", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert obj_endpoint({"bucket": "b"}, environ=environ)[0] == "https://s3.ap-south-1.amazonaws.com"
    params = {"bucket": "b", "region": "cn-north-1", "scheme": "http"}
    assert obj_endpoint(params, environ=environ)[0] == "http://s3.cn-north-1.amazonaws.com.cn"
    assert obj_endpoint({"endpoint_override": "127.0.0.1:9000", "scheme": "http"}, environ={}) == (
        "http://127.0.0.1:9000",
        "endpoint_override",
    )


def refused_before_l1(adapter: dict[str, Any]) -> tuple[int, str]:
    """(exit code, the one ``error:`` line) of ``serve`` with ``adapter``, asked for an L1
    larger than the machine has: a refusal other than the L1 check's (which comes after
    the adapters' pre-flight) came before L1 was allocated."""
    serve = ["serve", "--l1-size-gb", "100000", "--port", "0", "--metrics-port", "0"]
    done = subprocess.run(
        [*CLI, *serve, "--l2-adapter", json.dumps(adapter)],
        env={**unset_module_env(), "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    return done.returncode, errors[0]


def test_serve_with_an_unreachable_azure_blob_endpoint_exits_2_in_one_line() -> None:
    """Refused by the adapters' pre-flight: before L1 is allocated (the L1 asked for here
    is more than the machine has, which the L1 check after the pre-flight would refuse)."""
    closed = free_port()
    adapter = {
        "type": "nixl_store",
        "backend": "AZURE_BLOB",
        "pool_size": 4,
        "backend_params": {"account_url": f"http://127.0.0.1:{closed}/acct", "container_name": "kv"},
    }
    code, error = refused_before_l1(adapter)
    assert code == 2, error
    assert (
        f"AZURE_BLOB endpoint http://127.0.0.1:{closed}/acct (127.0.0.1:{closed}) cannot be reached" in error
    )


def test_direct_io_is_refused_where_the_filesystem_does_not_take_it(tmp_path: Path) -> None:
    from lmcache_plugin_nixl.availability import check_direct_io

    from lmcache_tiers.testing.mounts import tmpfs_at

    if direct_io_refusal(str(tmp_path)) is None:
        check_direct_io(str(tmp_path))  # a filesystem that takes O_DIRECT passes
    with tmpfs_at(str(tmp_path / "ramfs"), "mode=0700", fstype="ramfs") as refused:
        if refused is not None:
            pytest.skip(refused)
        with pytest.raises(
            FieldError, match=r'use_direct_io is "true" but .* does not support O_DIRECT'
        ) as caught:
            check_direct_io(str(tmp_path / "ramfs"))
        assert caught.value.field == "backend_params.use_direct_io", "start-up names the adapter and the path"
        assert os.listdir(tmp_path / "ramfs") == [], "the probe leaves nothing behind"


def test_serve_names_the_adapter_and_path_of_a_misspelt_nixl_parameter(tmp_path: Path) -> None:
    adapters = [
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "pool_size": 2,
            "backend_params": {"file_path": str(tmp_path / "pool"), "use_direct_io": "false"},
        },
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {
                "file_path": str(tmp_path / "records"),
                "use_direct_io": "false",
                "max_capacity_gb": "1",
                "use_urin": "true",
            },
        },
    ]
    error, output = serve_refusal(adapters, unset_module_env())
    assert "backend_params use_urin not understood by NIXL's POSIX plugin" in error
    assert "nixl_store_dynamic" in error
    assert error.endswith("- at `$.l2_adapters[1].backend_params.use_urin`")
    assert "Traceback" not in output


def test_an_aws_endpoint_out_of_reach_is_refused_naming_endpoint_override_as_the_way_out() -> None:
    # A name that does not resolve stands in for a host with no route to AWS.
    def unresolvable(host: str, port: int) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(FieldError) as caught:
        check_remote_endpoint("OBJ", {"bucket": "b", "region": "eu-west-1"}, environ={}, resolve=unresolvable)
    assert caught.value.field == "backend_params.region"
    assert str(caught.value).startswith(
        "OBJ endpoint https://s3.eu-west-1.amazonaws.com (s3.eu-west-1.amazonaws.com:443) cannot be "
        "reached: Name or service not known; with no backend_params.endpoint_override this is AWS's own "
        "endpoint of the region"
    )


@pytest.mark.parametrize(
    ("backend", "params", "path"),
    [
        ("OBJ", {"bucket": "b", "endpoint_override": "http://127.0.0.1:{closed}"}, "endpoint_override"),
        (
            "AZURE_BLOB",
            {"account_url": "http://127.0.0.1:{closed}/acct", "container_name": "kv"},
            "account_url",
        ),
        ("AZURE_BLOB", {"account_url": "acct.blob.core.windows.net", "container_name": "kv"}, "account_url"),
    ],
)
def test_serve_names_the_adapter_and_path_of_an_endpoint_it_cannot_use(
    backend: str, params: dict[str, str], path: str, tmp_path: Path
) -> None:
    closed = free_port()
    adapters: list[dict[str, Any]] = [
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "pool_size": 2,
            "backend_params": {"file_path": str(tmp_path / "pool"), "use_direct_io": "false"},
        },
        {
            "type": "nixl_store",
            "backend": backend,
            "pool_size": 4,
            "backend_params": {key: value.format(closed=closed) for key, value in params.items()},
        },
    ]
    error, output = serve_refusal(adapters, unset_module_env())
    # refused by the pre-flight, before L1: the adapter is the one at the path's index
    assert error.startswith("error: nixl_store: "), error
    assert f"{backend} endpoint" in error or "is not a URL with a host name" in error
    assert error.endswith(f"- at `$.l2_adapters[1].backend_params.{path}`")
    assert "Traceback" not in output


def test_serve_names_the_second_adapter_passing_other_parameters_to_one_backend(tmp_path: Path) -> None:
    adapters = [
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "pool_size": 2,
            "backend_params": {"file_path": str(tmp_path / str(n)), "use_direct_io": "false", **extra},
        }
        for n, extra in enumerate(({}, {"kernel_queue_size": "64"}))
    ]
    error, output = serve_refusal(adapters, unset_module_env())
    assert "already initialised in this process with other parameters (kernel_queue_size differs)" in error
    assert "1:nixl_store: l2 adapter 'nixl_store'" in error
    assert error.endswith("- at `$.l2_adapters[1].backend_params.kernel_queue_size`")
    assert "Traceback" not in output


@pytest.mark.skipif(
    ctypes.util.find_library("cufile") is not None,
    reason="libcufile is installed here; the missing-cuFile path cannot be shown",
)
@pytest.mark.parametrize("kind", ["nixl_store", "nixl_store_dynamic"])
def test_serve_refuses_gds_without_cufile_before_l1(kind: str, tmp_path: Path) -> None:
    """In the pre-flight: the L1 asked for here is more than the machine has, which the
    L1 check after the pre-flight would refuse."""
    adapter = {
        "type": kind,
        "backend": "GDS",
        "backend_params": {
            "file_path": str(tmp_path),
            "use_direct_io": "false",
            **({} if kind == "nixl_store" else {"max_capacity_gb": "1"}),
        },
        **({"pool_size": 2} if kind == "nixl_store" else {}),
    }
    assert refused_before_l1(adapter) == (
        1,
        "error: cannot start the server: NIXL backend GDS needs NVIDIA cuFile (libcufile, CUDA's "
        "GPUDirect Storage library), which is not installed on this machine",
    )
