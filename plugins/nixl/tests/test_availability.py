"""Backends that cannot run here fail at start-up with one clear line, before NIXL hangs."""

from __future__ import annotations

import ctypes.util
import os
from typing import Any, TypeVar

import msgspec
import pytest
from lmcache_plugin_nixl.availability import check_native_prerequisites
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from lmcache_plugin_nixl.dynamic import NixlDynamicBackend
from lmcache_plugin_nixl.runtime import NixlRuntime
from lmcache_plugin_nixl.store import NixlStoreBackend
from nixl_helpers import dynamic_config, open_dynamic, open_pool, pool_config, scratch_dir

from lmcache_tiers.config import FieldError
from lmcache_tiers.errors import BackendUnavailableError, ConfigError
from lmcache_tiers.testing.files import held_by_another_process

CUFILE_MISSING = ctypes.util.find_library("cufile") is None


ConfigT = TypeVar("ConfigT", NixlStoreConfig, NixlStoreDynamicConfig)


def _with_backend(config: ConfigT, backend: str) -> ConfigT:
    return msgspec.structs.replace(config, backend=backend)


@pytest.mark.skipif(
    not CUFILE_MISSING, reason="libcufile is installed here; the missing-cuFile path cannot be shown"
)
@pytest.mark.parametrize("backend", ["GDS", "GDS_MT"])
def test_gds_without_cufile_fails_at_start_up_naming_cufile(backend: str) -> None:
    with scratch_dir() as directory:
        for config in (pool_config(directory), dynamic_config(directory)):
            with pytest.raises(BackendUnavailableError) as caught:
                if isinstance(config, NixlStoreConfig):
                    open_pool(_with_backend(config, backend))
                else:
                    open_dynamic(_with_backend(config, backend))
            message = str(caught.value)
            assert "\n" not in message
            assert backend in message and "cuFile" in message and "libcufile" in message
    # Refused before NIXL was asked to create the backend (which is what can hang).
    assert backend not in NixlRuntime.shared().agent.backends


@pytest.mark.parametrize("backend", ["GDS", "GDS_MT"])
def test_gds_prerequisites_are_checked_in_order(backend: str) -> None:
    present = {"cufile": "libcufile.so.0", "cuda": "libcuda.so.1"}
    with pytest.raises(BackendUnavailableError, match="libcufile"):
        check_native_prerequisites(backend, find_library=lambda name: None, gpu_present=lambda: True)
    with pytest.raises(BackendUnavailableError, match="libcuda"):
        check_native_prerequisites(
            backend,
            find_library=lambda name: present.get(name) if name == "cufile" else None,
            gpu_present=lambda: True,
        )
    with pytest.raises(BackendUnavailableError, match="NVIDIA GPU"):
        check_native_prerequisites(backend, find_library=present.get, gpu_present=lambda: False)
    check_native_prerequisites(backend, find_library=present.get, gpu_present=lambda: True)


def test_posix_needs_no_native_prerequisite() -> None:
    check_native_prerequisites("POSIX", find_library=lambda name: None, gpu_present=lambda: False)


def test_hf3fs_missing_from_the_wheel_is_named() -> None:
    runtime = NixlRuntime.shared()
    if "HF3FS" in runtime.plugins():
        pytest.skip(f"{runtime.module_name} ships an HF3FS plugin; the missing-plugin path cannot be shown")
    with scratch_dir() as directory, pytest.raises(BackendUnavailableError) as caught:
        open_dynamic(_with_backend(dynamic_config(directory), "HF3FS"))
    message = str(caught.value)
    assert "\n" not in message
    assert "HF3FS" in message and "no HF3FS plugin" in message and "POSIX" in message


@pytest.mark.parametrize("backend_up", [False, True], ids=["first", "backend-already-up"])
def test_unknown_nixl_parameter_lists_what_the_plugin_accepts(backend_up: bool) -> None:
    """Named as a misspelling even where an adapter of this process created the backend
    already (not as a clash with that adapter's parameters)."""
    with scratch_dir() as directory:
        first = open_pool(pool_config(directory + "/a")) if backend_up else None
        try:
            raw = msgspec.to_builtins(pool_config(directory + "/b"))
            raw["backend_params"]["use_urin"] = "true"
            config = msgspec.convert(raw, NixlStoreConfig)
            with pytest.raises(FieldError) as caught:
                open_pool(config)
        finally:
            if first is not None:
                first.close()
    assert "use_urin" in str(caught.value) and "use_uring" in str(caught.value)
    assert caught.value.field == "backend_params.use_urin"


def test_same_backend_with_other_nixl_parameters_is_refused() -> None:
    with scratch_dir() as directory:
        first = open_pool(pool_config(directory + "/a"))
        try:
            raw = msgspec.to_builtins(pool_config(directory + "/b"))
            raw["backend_params"]["kernel_queue_size"] = "64"
            with pytest.raises(
                FieldError, match=r"already initialised .* \(kernel_queue_size differs\)"
            ) as caught:
                open_pool(msgspec.convert(raw, NixlStoreConfig))
            assert caught.value.field == "backend_params.kernel_queue_size", "start-up names the adapter"
        finally:
            first.close()


def test_two_adapters_on_one_directory_are_refused() -> None:
    with scratch_dir() as directory:
        first = open_dynamic(dynamic_config(directory))
        try:
            with pytest.raises(ConfigError, match="already used by another adapter of this server"):
                open_dynamic(dynamic_config(directory))
        finally:
            first.close()
        open_dynamic(dynamic_config(directory)).close()


@pytest.mark.parametrize("kind", ["nixl_store", "nixl_store_dynamic"])
def test_the_preflight_refuses_a_directory_another_server_holds(kind: str) -> None:
    backend, make_config, opener = {
        "nixl_store": (NixlStoreBackend, pool_config, open_pool),
        "nixl_store_dynamic": (NixlDynamicBackend, dynamic_config, open_dynamic),
    }[kind]
    with scratch_dir() as directory:
        root = f"{directory}/cache"
        cfg: Any = make_config(root)
        with held_by_another_process(root) as holder:
            with pytest.raises(FieldError) as caught:
                backend.preflight(cfg)
            assert caught.value.field == "backend_params.file_path"
            assert str(caught.value) == (
                f"the {kind} directory {root} is in use by another lmcache-tiers server "
                f"(pid {holder.pid}); give each server its own directory"
            )
        backend.preflight(cfg)  # the holder is gone
        adapter = opener(cfg)
        try:
            with pytest.raises(FieldError, match="is already used by another adapter of this server"):
                backend.preflight(cfg)
        finally:
            adapter.close()
        backend.preflight(make_config(f"{directory}/new"))
        assert sorted(os.listdir(directory)) == ["cache"]  # the pre-flight created nothing
