"""The configuration reference says that a policy's options run at their defaults: the
configuration names a policy, never its options, so a table alone would read as settable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmcache_tiers.config import build_config
from lmcache_tiers.config_docs import policy_options_note, render_config_reference
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_plugins
from lmcache_tiers.registry import Kind


def _section(reference: str, title: str) -> str:
    start = reference.index(title)
    end = reference.find("\n### ", start + len(title))
    return reference[start : end if end != -1 else len(reference)]


@pytest.fixture(scope="module")
def reference() -> str:
    return render_config_reference(load_plugins())


@pytest.mark.parametrize("name", ["PREFIX_LFU", "S3FIFO"])
def test_a_policy_with_options_says_they_run_at_their_defaults(reference: str, name: str) -> None:
    section = _section(reference, f"### `{name}` ")
    note = policy_options_note(Kind.EVICTION_POLICY)
    assert note and note in section
    assert section.index(note) < section.index("| field |"), "the note belongs before the table"


def test_a_policy_without_options_gets_no_note(reference: str) -> None:
    section = _section(reference, "### `LRU` ")
    assert "No options." in section
    assert policy_options_note(Kind.EVICTION_POLICY) not in section


def test_no_adapter_field_sets_a_policy_option() -> None:
    """What the note claims: the eviction object names the policy and nothing of its own."""
    adapter = {
        "type": "mock",
        "max_size_gb": 0.01,
        "eviction": {"eviction_policy": "PREFIX_LFU", "frequency_credit": 3.0},
    }
    with pytest.raises(ConfigError, match=r"unknown field `frequency_credit`"):
        build_config(load_plugins().registry, adapter_json=[json.dumps(adapter)])
    with pytest.raises(ConfigError, match=r"unknown config field `\$\.frequency_credit`"):
        build_config(load_plugins().registry, {"frequency_credit": 3.0})


def test_other_kinds_get_no_note() -> None:
    assert policy_options_note(Kind.L2_ADAPTER) == ""
    assert policy_options_note(Kind.SERDE) == ""
    assert policy_options_note(Kind.FRONTEND) == ""


@pytest.mark.parametrize(("name", "has_options"), [("PREFIX_LFU", True), ("LRU", False)])
def test_plugins_show_says_so_too(name: str, has_options: bool) -> None:
    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "plugins", "show", name]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="120")
    )
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stdout.split())  # the note wraps at the terminal's width
    assert (policy_options_note(Kind.EVICTION_POLICY) in shown) is has_options, shown
