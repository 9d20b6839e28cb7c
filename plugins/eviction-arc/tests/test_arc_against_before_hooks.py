"""ARC without keys set aside walks, adapts ``p`` and keeps its ghosts exactly as the ARC
written before set_aside/put_back existed: that version is loaded from git history and
both are driven by the same random writes, reads, walks and removals."""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from lmcache_plugin_eviction_arc.policy import ARCEvictionPolicy

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.policies import make_keys

#: the last commit before ARC gained set_aside/put_back (its walk was rewritten then)
BEFORE_HOOKS = "a1f7f30c496ecfc5af554ce52d2edcb6b8f0a93e"
POLICY_PATH = "plugins/eviction-arc/src/lmcache_plugin_eviction_arc/policy.py"
REPO = Path(__file__).resolve().parents[3]


def arc_before_hooks(tmp_path: Path) -> type:
    """The ARC class of ``BEFORE_HOOKS``, imported from its source into a temp module."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("the reference ARC comes from git history, absent here")
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{BEFORE_HOOKS}:{POLICY_PATH}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if shown.returncode != 0:
        pytest.skip(f"git history lacks {BEFORE_HOOKS}: {shown.stderr.strip()}")
    path = tmp_path / "arc_before_hooks.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("arc_before_hooks", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.ARCEvictionPolicy


def state(policy: object) -> tuple[object, ...]:
    return (
        list(policy._recent),  # type: ignore[attr-defined]
        list(policy._frequent),  # type: ignore[attr-defined]
        list(policy._recent_ghosts),  # type: ignore[attr-defined]
        list(policy._frequent_ghosts),  # type: ignore[attr-defined]
        policy._target,  # type: ignore[attr-defined]
        len(policy),  # type: ignore[arg-type]
    )


def random_batch(rng: random.Random, keys: list[ObjectKey]) -> list[ObjectKey]:
    start = rng.randrange(len(keys))
    return keys[start : start + rng.randint(1, 6)]


@pytest.mark.parametrize("seed", range(40))
def test_arc_without_keys_set_aside_is_the_arc_before_the_hooks(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    keys = make_keys(rng.choice((12, 40, 120)))
    old, new = arc_before_hooks(tmp_path)(), ARCEvictionPolicy()
    for _ in range(600):
        action = rng.random()
        if action < 0.45:
            batch = random_batch(rng, keys)
            old.on_keys_written(batch)
            new.on_keys_written(batch)
        elif action < 0.7:
            batch = random_batch(rng, keys)
            old.on_keys_read(batch)
            new.on_keys_read(batch)
        elif action < 0.8:
            gone = rng.sample(keys, rng.randint(1, 4))  # removed for another reason
            old.on_keys_removed(gone)
            new.on_keys_removed(gone)
        else:
            # A walk taken part way, some of it evicted (some passed over), then reported.
            wanted = rng.randint(0, len(keys))
            old_walk, new_walk = old.victims(), new.victims()
            offered = [key for key, _ in zip(old_walk, range(wanted), strict=False)]
            assert [key for key, _ in zip(new_walk, range(wanted), strict=False)] == offered
            evicted = [key for key in offered if rng.random() < 0.8]
            old.on_keys_removed(evicted)
            new.on_keys_removed(evicted)
        assert state(new) == state(old)
        assert list(new.victims()) == list(old.victims())
        new.on_keys_removed([])  # the full comparison walks evicted nothing
        old.on_keys_removed([])
