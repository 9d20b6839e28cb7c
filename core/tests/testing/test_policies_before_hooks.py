"""Without keys set aside, each eviction policy with set_aside/put_back walks and keeps its
state exactly as it did before it had the hooks (with the fixes made since to what the hooks
did not touch, ``LATER_FIXES``): that version is loaded from git history
and both are driven by the same random writes, reads, removals and partial walks (each
with some victims passed over, as locked or unstored ones are, and never set aside).

The hooks brought rewrites the replay figures cannot check alone: ARC's walk in three
phases (its target ``p``, ghosts and their bounds), S3-FIFO's victims stamped in offer
order, PREFIX_LFU's levels kept for runs put back, LRU's runs of keys put back."""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_eviction_arc.policy import ARCEvictionPolicy
from lmcache_plugin_eviction_lru.policy import LRUEvictionPolicy
from lmcache_plugin_eviction_prefix_lfu.policy import PrefixLFUEvictionPolicy
from lmcache_plugin_eviction_s3fifo.policy import S3FIFOEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import make_keys

#: the last commit before any eviction policy gained set_aside/put_back
BEFORE_HOOKS = "bd6a5c4e3ccc8071a6eb45afe2d77ad6c36d5476"
REPO = Path(__file__).resolve().parents[3]


def _copies(*names: str) -> Callable[[Any], tuple[object, ...]]:
    """The policy's state as plain values: the named attributes, each copied."""

    def state(policy: Any) -> tuple[object, ...]:
        values = (getattr(policy, name) for name in names)
        return tuple(value if isinstance(value, float | int) else _plain(value) for value in values)

    return state


def _plain(value: Any) -> object:
    if isinstance(value, dict):
        return [(key, _plain(item)) for key, item in value.items()]
    return list(value) if isinstance(value, list) else value


#: policy, the directory of its plugin, and the state both versions keep alike
POLICIES = {
    "ARC": (
        ARCEvictionPolicy,
        "eviction-arc/src/lmcache_plugin_eviction_arc",
        _copies("_recent", "_frequent", "_recent_ghosts", "_frequent_ghosts", "_target"),
    ),
    "LRU": (LRUEvictionPolicy, "eviction-lru/src/lmcache_plugin_eviction_lru", _copies("_order")),
    "PREFIX_LFU": (
        PrefixLFUEvictionPolicy,
        "eviction-prefix-lfu/src/lmcache_plugin_eviction_prefix_lfu",
        _copies("_state", "_history", "_buckets", "_tick"),
    ),
    "S3FIFO": (
        S3FIFOEvictionPolicy,
        "eviction-s3fifo/src/lmcache_plugin_eviction_s3fifo",
        _copies("_small", "_due", "_main", "_ghosts", "_frequency"),
    ),
}


#: fixes made since ``BEFORE_HOOKS`` that change behaviour the hooks did not touch: applied to
#: the old source (each text must occur in it exactly once) so that only the hooks differ
LATER_FIXES: dict[str, list[tuple[str, str]]] = {
    # a read takes the keys it moves to the main queue tail first, as writes do (9b35af6c)
    "S3FIFO": [
        (
            "for key in keys:\n            if key in frequency:\n                self._count_read",
            "for key in reversed(keys):\n            if key in frequency:\n                self._count_read",
        )
    ],
}


def policy_before_hooks(name: str, plugin_dir: str, tmp_path: Path) -> type:
    """The policy class of ``BEFORE_HOOKS``, imported from its source into a temp module."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("the policies before the hooks come from git history, absent here")
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{BEFORE_HOOKS}:plugins/{plugin_dir}/policy.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shown.returncode != 0:
        pytest.skip(f"git history lacks {BEFORE_HOOKS}: {shown.stderr.strip()}")
    module_name = f"before_hooks_{name.lower()}"
    path = tmp_path / f"{module_name}.py"
    source = shown.stdout
    for old, new in LATER_FIXES.get(name, []):
        assert source.count(old) == 1, f"a later fix no longer applies to {name} before the hooks"
        source = source.replace(old, new)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[module_name]
    class_name: str = POLICIES[name][0].__name__
    return getattr(module, class_name)  # type: ignore[no-any-return]


def random_batch(rng: random.Random, keys: list[ObjectKey]) -> list[ObjectKey]:
    start = rng.randrange(len(keys))
    return keys[start : start + rng.randint(1, 6)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_without_keys_set_aside_a_policy_is_the_one_before_the_hooks(
    name: str, seed: int, tmp_path: Path
) -> None:
    new_class, plugin_dir, state = POLICIES[name]
    rng = random.Random(seed)
    keys = make_keys(rng.choice((12, 40, 120)))
    old, new = policy_before_hooks(name, plugin_dir, tmp_path)(), new_class()

    def both(event: str, batch: list[ObjectKey]) -> None:
        getattr(old, event)(batch)
        getattr(new, event)(batch)

    for _ in range(600):
        action = rng.random()
        if action < 0.45:
            both("on_keys_written", random_batch(rng, keys))
        elif action < 0.7:
            both("on_keys_read", random_batch(rng, keys))
        elif action < 0.8:
            both("on_keys_removed", rng.sample(keys, rng.randint(1, 4)))  # removed for another reason
        else:
            # A walk taken part way, some of it evicted (the rest passed over), then reported.
            wanted = rng.randint(0, len(keys))
            offered = [key for key, _ in zip(old.victims(), range(wanted), strict=False)]
            walk = [key for key, _ in zip(new.victims(), range(wanted), strict=False)]
            assert walk == offered, f"{name}'s walk is not the one before the hooks"
            both("on_keys_removed", [key for key in offered if rng.random() < 0.8])
        assert state(new) == state(old), f"{name}'s state is not the one before the hooks"
        assert len(new) == len(old)
    assert list(new.victims()) == list(old.victims())
