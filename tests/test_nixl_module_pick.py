"""Which NIXL wheel a server loads on a host without a CUDA stack is decided at every
start of an adapter on NIXL: the decision must not import torch (a second or more of
CPU, per start, for the answer torch's version file already gives)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

_PICK = """
import ctypes.util, importlib.util, json, sys
from lmcache_plugin_nixl.runtime import default_module
module, reason = default_module()
torch_imported = "torch" in sys.modules
try:
    from nixl_meta_utils import detect_cuda_major
except ImportError:
    cuda_major = None
else:
    cuda_major = detect_cuda_major()  # may import torch: after the check above
both = all(importlib.util.find_spec(name) for name in ("nixl_cu12", "nixl_cu13"))
cuobj = ctypes.util.find_library("cuobjclient") is not None
print(json.dumps({"module": module, "reason": reason, "torch_imported": torch_imported,
                  "cu12_expected": both and cuda_major is None and not cuobj}))
"""


def test_picking_the_nixl_module_imports_no_torch_and_agrees_with_nixl_detection() -> None:
    if importlib.util.find_spec("lmcache_plugin_nixl") is None:
        pytest.skip("lmcache-plugin-nixl is not installed")
    done = subprocess.run([sys.executable, "-c", _PICK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pick = json.loads(done.stdout.splitlines()[-1])
    assert not pick["torch_imported"], pick
    # The CUDA 12 wheel is taken exactly where NIXL's own detection (which imports torch
    # when its version file names no CUDA) finds no CUDA stack either.
    assert (pick["module"] == "nixl_cu12._api") == pick["cu12_expected"], pick
