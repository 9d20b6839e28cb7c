"""``lmcache-tiers plugins``: what is installed and how each component is configured."""

from __future__ import annotations

import difflib
import json

import typer
from rich.markup import escape
from rich.table import Table

from lmcache_tiers.cli import plugins_new
from lmcache_tiers.cli.output import EXIT_USAGE, fail, stdout, warn
from lmcache_tiers.config_docs import (
    FieldDoc,
    UndescribedConfigError,
    component_doc,
    component_fields,
    policy_options_note,
    render_config_reference,
)
from lmcache_tiers.plugins import load_plugins
from lmcache_tiers.registry import CONTEST_WAY_OUT, Component, contest_text

app = typer.Typer(
    help="List installed plugins, show their components' configuration, write new ones.",
    no_args_is_help=True,
)
app.command("new")(plugins_new.new)


@app.command("list")
def list_plugins(
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of a table."),
) -> None:
    """List every plugin found through the `lmcache_tiers` entry points."""
    plugin_set = load_plugins()
    if as_json:
        rows = [
            {
                "plugin": p.name,
                "distribution": p.distribution,
                "version": p.version,
                "module": p.module,
                "components": p.components,
                "status": p.status,
            }
            for p in plugin_set.plugins
        ]
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="lmcache-tiers plugins", title_justify="left")
    table.add_column("plugin", style="bold")
    table.add_column("version")
    table.add_column("components")
    table.add_column("status")
    for p in plugin_set.plugins:
        # Names and errors are text: `list[int]` in an error is not a style tag.
        status = "[green]ok[/]" if p.status == "ok" else f"[red]{escape(p.status)}[/]"
        components = escape("\n".join(p.components)) or "-"
        table.add_row(escape(p.name), escape(p.version), components, status)
    stdout.print(table)


def _matching_components(name: str) -> list[Component]:
    plugin_set = load_plugins()
    wanted = name.lower()
    by_plugin = [p for p in plugin_set.plugins if wanted in (p.name.lower(), p.distribution.lower())]
    # each claimant of a contested name too: `plugins show` of either plugin lists it
    components = list(plugin_set.registry.all_components())
    if by_plugin:
        dists = {p.distribution for p in by_plugin}
        return [c for c in components if c.plugin in dists]
    return [c for c in components if wanted in (c.name.lower(), c.qualified_name.lower())]


@app.command("show")
def show(name: str = typer.Argument(..., help="A plugin name, or a component as NAME or KIND:NAME.")) -> None:
    """Show each component's config fields with types, defaults, constraints and docs."""
    plugin_set = load_plugins()
    named = [p for p in plugin_set.plugins if name.lower() in (p.name.lower(), p.distribution.lower())]
    for plugin in named:
        if plugin.disabled:
            # Never loaded, so nothing it registers is known: not "registers no components".
            fail(f"plugin {plugin.name!r} is {plugin.status}: its components are not loaded", 1)
        if plugin.commands_only:
            # Its components registered and serve can use them: only its commands are out.
            warn(f"plugin {plugin.name!r}: {plugin.error}")
        elif plugin.error:
            fail(f"plugin {plugin.name!r} did not load: {plugin.error}", 1)
    components = _matching_components(name)
    if not components and named:
        stdout.print(f"plugin {named[0].name!r} registers no components", markup=False)
        return
    if not components:
        known = ", ".join(p.name for p in plugin_set.plugins) or "none"
        names = {p.name.lower() for p in plugin_set.plugins}
        names.update(c.name.lower() for c in plugin_set.registry.components())
        close = difflib.get_close_matches(name.lower(), sorted(names), n=1, cutoff=0.6)
        suggestion = f"did you mean {close[0]!r}? " if close else ""
        fail(f"no plugin or component named {name!r}; {suggestion}installed plugins: {known}", EXIT_USAGE)
    contested = {each[0].qualified_name.lower(): each for each in plugin_set.registry.contested()}
    for component in components:
        title = f"{component.qualified_name}  (plugin {component.plugin})"
        # once a name: `plugins show KIND:NAME` lists every claimant of it
        claimants = contested.pop(component.qualified_name.lower(), None)
        if claimants is not None:
            warn(f"{contest_text(claimants)}; {CONTEST_WAY_OUT}")
        fields: list[FieldDoc] | None
        try:
            fields = component_fields(component.config)
        except UndescribedConfigError as exc:
            stdout.print(f"{title}\noptions cannot be listed: {exc}", markup=False)
            fields = None
        if fields:
            table = Table(title=escape(title), title_justify="left")
            for column in ("field", "type", "default", "constraints", "doc"):
                table.add_column(column)
            for field in fields:
                # text, not markup: `list[object]` keeps its `[object]`
                table.add_row(*(escape(cell) for cell in field))
            stdout.print(table)
            # Listed as options, yet no setting reaches them: say so, as the reference does.
            note = policy_options_note(component.kind)
            if note:
                stdout.print(note, markup=False)
        elif fields is not None:
            stdout.print(f"[italic]{escape(title)}[/]\nno options", markup=True)
        doc = component_doc(component)
        if doc:
            stdout.print(doc, markup=False)
        stdout.print()


@app.command("reference")
def reference() -> None:
    """Print the configuration reference (Markdown) generated from the config schemas."""
    plugin_set = load_plugins()
    for plugin in plugin_set.unusable:
        # The reference goes to a file: without this line it would lack their sections unsaid.
        warn(f"plugin {plugin.name} failed to load: {plugin.error}; its components are not documented")
    for line in plugin_set.contest_lines():
        # documented under each claimant, as refused by serve
        warn(line)
    typer.echo(render_config_reference(plugin_set), nl=False)
