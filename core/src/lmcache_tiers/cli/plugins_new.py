"""``lmcache-tiers plugins new``: write a ready plugin package from a skeleton.

Each kind's skeleton (``cli/skeletons/<kind>/``) is a working component -- an in-memory
L2 backend, an every-key store policy, a lowest-index prefetch policy, a FIFO eviction
policy, a framing serde, a front end speaking a small JSON protocol over ZeroMQ -- with
the manifest, a test that subclasses the conformance suite of its kind, a README and a
pyproject whose entry point is all core needs to find it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from lmcache_tiers.cli.output import fail, stdout
from lmcache_tiers.errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*\Z")  # \Z: $ also matches before a final newline
_TOKEN = re.compile(r"\{\{(\w+)\}\}")
_MAX_NAME = 40


class SkeletonKind(str, enum.Enum):
    L2 = "l2"
    STORE = "store"
    PREFETCH = "prefetch"
    EVICTION = "eviction"
    SERDE = "serde"
    FRONTEND = "frontend"


@dataclass(frozen=True)
class _Skeleton:
    implementation: str  # module name of the implementation
    kind_label: str  # the registry kind, as `plugins list` shows it
    description: str
    test_role: str
    usage: str
    #: what the implementation imports besides lmcache-tiers and msgspec
    dependencies: tuple[str, ...] = ()


_SKELETONS = {
    SkeletonKind.L2: _Skeleton(
        "backend",
        "l2_adapter",
        "the L2 adapter type `{component}` (objects in process memory; a starting point for a real backend)",
        "subclasses `L2AdapterSuite`, the conformance suite every L2 adapter passes",
        'Use it: `lmcache-tiers serve --l2-adapter \'{{"type": "{component}", "max_size_gb": 1}}\'`.',
    ),
    SkeletonKind.STORE: _Skeleton(
        "policy",
        "store_policy",
        "the store policy `{component}` (every key to every adapter)",
        "subclasses `StorePolicySuite`, the conformance suite of store policies",
        "Use it: `lmcache-tiers serve --l2-store-policy {component}`.",
    ),
    SkeletonKind.PREFETCH: _Skeleton(
        "policy",
        "prefetch_policy",
        "the prefetch policy `{component}` (lowest-index adapter first)",
        "subclasses `PrefetchPolicySuite`, the conformance suite of prefetch policies",
        "Use it: `lmcache-tiers serve --l2-prefetch-policy {component}`.",
    ),
    SkeletonKind.EVICTION: _Skeleton(
        "policy",
        "eviction_policy",
        "the eviction policy `{component}` (first in, first out)",
        "subclasses `EvictionPolicySuite`, the conformance suite of eviction policies",
        "Use it: `lmcache-tiers serve --eviction-policy {component}`, or as an adapter's "
        '`"eviction": {{"eviction_policy": "{component}"}}`.',
    ),
    SkeletonKind.SERDE: _Skeleton(
        "serde",
        "serde",
        "the serde `{component}` (frames each object with its length)",
        "subclasses `SerdeSuite`, the conformance suite of serdes",
        'Use it in an adapter\'s chain: `"serde": [{{"type": "{component}"}}]`.',
    ),
    SkeletonKind.FRONTEND: _Skeleton(
        "frontend",
        "frontend",
        "the front end `{component}` (lookups, stores and retrieves of token chunks, JSON over ZeroMQ)",
        "subclasses `FrontendSuite`, the conformance suite every front end passes, with a "
        "`FrontendDriver` speaking its protocol",
        'Serve it next to the native protocol: `lmcache-tiers serve --frontend \'{{"type": "native"}}\' '
        '--frontend \'{{"type": "{component}", "port": 5556}}\'`.',
        ("pyzmq>=25",),
    ),
}


def plugin_values(name: str, kind: SkeletonKind) -> dict[str, str]:
    """Every name the skeleton files are filled in with, derived from ``name``."""
    if not _NAME.match(name) or len(name) > _MAX_NAME:
        raise ConfigError(
            f"plugin name {name!r} must be lowercase letters and digits in words joined by '-', "
            f"starting with a letter (e.g. my-store), at most {_MAX_NAME} characters"
        )
    skeleton = _SKELETONS[kind]
    component = name.replace("-", "_")
    values = {
        "entry": name,
        "dist": f"lmcache-plugin-{name}",
        "package": f"lmcache_plugin_{component}",
        "component": component,
        "Title": "".join(part.capitalize() for part in name.split("-")),
        "magic": (component.upper() + "____")[:4],
        "implementation": skeleton.implementation,
        "kind_label": skeleton.kind_label,
        "test_role": skeleton.test_role,
        "dependencies": ", ".join(
            f'"{dependency}"' for dependency in ("lmcache-tiers", "msgspec>=0.18", *skeleton.dependencies)
        ),
    }
    values["description"] = skeleton.description.format(component=component)
    values["usage"] = skeleton.usage.format(component=component)
    return values


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def refuse_installed_names(name: str, kind: SkeletonKind) -> None:
    """ConfigError when plugin ``name`` would collide with what is installed: its
    distribution would replace the installed one, an entry point of the same name makes
    both plugins refuse to load, and a component of the same name fails the registration
    of one of them (the generated plugin, or the installed one it shadows)."""
    from lmcache_tiers.plugins import load_plugins
    from lmcache_tiers.registry import Kind

    values = plugin_values(name, kind)
    plugin_set = load_plugins()
    hint = "; pick another name"
    for info in plugin_set.plugins:
        if _normalized(info.distribution) == _normalized(values["dist"]):
            raise ConfigError(
                f"{values['dist']} is installed: installing this one would replace it{hint} "
                f"(or pip uninstall {values['dist']} first)"
            )
        if info.name.lower() == values["entry"]:
            raise ConfigError(
                f"the plugin {info.name!r} of {info.distribution} is installed: two entry points of "
                f"one name stop both from loading{hint}"
            )
    component_kind = Kind(values["kind_label"])
    taken = {c.lower(): c for c in plugin_set.registry.names(component_kind)}
    if values["component"].lower() in taken:
        # (not ``get``: a name two plugins registered is refused there, and is taken all the same)
        owner = next(
            c.plugin
            for c in plugin_set.registry.components(component_kind)
            if c.name.lower() == values["component"].lower()
        )
        raise ConfigError(
            f"{component_kind.value}:{taken[values['component'].lower()]} is installed (plugin "
            f"{owner}); names are matched ignoring case, so one of the two would not load{hint}"
        )


def render(text: str, values: dict[str, str]) -> str:
    return _TOKEN.sub(lambda match: values[match.group(1)], text)


def write_plugin(name: str, kind: SkeletonKind, directory: Path) -> Path:
    """Write the package of plugin ``name`` into ``directory/name``; returns that path."""
    values = plugin_values(name, kind)
    target = directory / name
    if target.exists():
        raise ConfigError(f"{target} already exists; pick another name or --dir")
    skeletons = resources.files("lmcache_tiers.cli") / "skeletons"
    package = target / "src" / values["package"]
    implementation = values["implementation"]
    files = {
        target / "pyproject.toml": skeletons / "common" / "pyproject.toml.tmpl",
        target / "README.md": skeletons / "common" / "README.md.tmpl",
        package / "__init__.py": skeletons / kind.value / "__init__.py.tmpl",
        package / f"{implementation}.py": skeletons / kind.value / f"{implementation}.py.tmpl",
        target / "tests" / f"test_{values['component']}.py": skeletons / kind.value / "test.py.tmpl",
    }
    for path, template in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(template.read_text(), values))
    (package / "py.typed").write_text("")
    return target


def new(
    name: Annotated[str, typer.Argument(help="Plugin name, e.g. my-store: lmcache-plugin-my-store.")],
    kind: Annotated[SkeletonKind, typer.Option("--kind", help="What the plugin provides.")],
    directory: Annotated[Path, typer.Option("--dir", help="Where the package directory is created.")] = Path(
        "."
    ),
) -> None:
    """Write a ready plugin package: pyproject, manifest, working skeleton, test, README."""
    try:
        refuse_installed_names(name, kind)
        target = write_plugin(name, kind, directory)
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the plugin into {directory}: {exc}")
    stdout.print(f"wrote {target}", markup=False)
    stdout.print(
        f"next: pip install -e '{target}[test]', lmcache-tiers plugins list, pytest {target}/tests",
        markup=False,
    )
