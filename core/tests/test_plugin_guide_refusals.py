"""Refusals docs/plugin-guide.md tells a plugin author about, checked against serve.

Each test installs a one-file plugin (a dist-info with its entry point, put on
PYTHONPATH), runs ``lmcache-tiers serve`` on it, and checks the exit status and the line
the guide describes, and that the guide describes them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lmcache_tiers.testing.ports import free_port

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-guide.md"
CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]


def guide_text() -> str:
    """The guide with its lines joined: a sentence or code span may wrap anywhere."""
    return re.sub(r"\s+", " ", GUIDE.read_text())


def install_flat_plugin(site: Path, name: str, source: str) -> None:
    module = f"guide_{name}"
    dist = site / f"lmcache_plugin_{name}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: lmcache-plugin-{name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[lmcache_tiers]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(source)


def serve(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [*CLI, "serve", "--l1-size-gb", "0.01", "--port", str(free_port()), "--metrics-port", "0"]
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    environ = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([*command, *args], capture_output=True, text=True, env=environ, timeout=120)


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


POLICY_WITHOUT_DEFAULT = """
from lmcache_tiers.plugin import ComponentConfig, hookimpl


class DepthConfig(ComponentConfig):
    depth: int


class DepthPolicy:
    def __init__(self, config):
        self.depth = config.depth


@hookimpl
def tiers_register_eviction_policies(registry):
    registry.add("guide_depth", DepthPolicy, DepthConfig)
"""


def test_a_policy_config_field_without_a_default_is_refused_as_the_guide_says(tmp_path: Path) -> None:
    install_flat_plugin(tmp_path, "guidedepth", POLICY_WITHOUT_DEFAULT)
    result = serve(tmp_path, "--no-default-l2", "--eviction-policy", "guide_depth")
    assert result.returncode == 2, result.stderr
    line = error_line(result.stderr)
    quoted = "`KIND:NAME needs configuration it cannot get from a flag: Missing required argument 'FIELD'`"
    assert quoted in guide_text(), "the guide no longer quotes the refusal"
    expected = quoted.strip("`").replace("KIND:NAME", "eviction_policy:guide_depth").replace("FIELD", "depth")
    assert line == f"error: {expected}", line
    assert "so give every field a default" in guide_text()


#: a backend plugin whose constructor runs ``construct`` and whose plain ``open`` runs
#: ``open`` (each a statement), registered as ``name``
BACKEND = """
import sys

from lmcache_tiers.plugin import FieldError, L2AdapterConfig, hookimpl


class Failing:
    def __init__(self, config, context):
        {construct}

    def open(self):
        {open}

    def put_many(self, keys, payloads):
        return [False] * len(keys)

    def contains_many(self, keys):
        return [None] * len(keys)

    def get_many_into(self, keys, buffers):
        return [False] * len(keys)

    def delete_many(self, keys):
        return [False] * len(keys)

    def list_keys(self):
        return []

    def capacity(self):
        return None


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("{name}", Failing, L2AdapterConfig)
"""

BACKEND_WHOSE_OPEN_RAISES = BACKEND.format(
    name="guide_unopened", construct="pass", open='raise RuntimeError("the store refused the session")'
)


def test_a_plain_backend_whose_open_raises_stops_serve_as_the_guide_says(tmp_path: Path) -> None:
    install_flat_plugin(tmp_path, "guideunopened", BACKEND_WHOSE_OPEN_RAISES)
    result = serve(tmp_path, "--l2-adapter", '{"type": "guide_unopened"}')
    assert result.returncode == 1, result.stderr
    line = error_line(result.stderr)
    assert line.startswith("error: cannot start the server: "), line
    assert line.endswith("RuntimeError: the store refused the session"), line
    assert "a plain `open` that raises makes `serve` refuse to start, one line and exit 1" in guide_text()


SECOND_FS = """
from lmcache_tiers.plugin import L2AdapterConfig, hookimpl


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("fs", "guide_secondfs:Backend", L2AdapterConfig)
"""


def test_plugins_show_of_a_plugin_registering_a_taken_name_warns_as_the_guide_says(tmp_path: Path) -> None:
    install_flat_plugin(tmp_path, "secondfs", SECOND_FS)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    environ = dict(os.environ, PYTHONPATH=path, COLUMNS="300")
    result = subprocess.run(
        [*CLI, "plugins", "show", "secondfs"], capture_output=True, text=True, env=environ, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [warning] = result.stderr.strip().splitlines()
    assert warning.startswith("warning: ") and "'fs'" in warning, warning
    assert "lmcache-plugin-secondfs" in warning and "lmcache-plugin-fs" in warning, warning
    assert "l2_adapter:fs  (plugin lmcache-plugin-secondfs)" in result.stdout, result.stdout
    text = guide_text()
    assert (
        "`plugins show` of either warns with the conflict on one line and shows the component (exit 0)"
        in text
    )
    # a conflict is not the error of the plugin that registered second
    assert "registers a component another plugin registered already or" not in text
