"""Entry point of the ``lmcache-tiers`` command: builds the typer app and runs it.

Usage errors (bad flag values, unknown options) and configuration errors are turned into
one line on stderr and exit code 2, never a traceback.  ``-h`` is ``--help`` on every
command and group, plugin commands included.
"""

from __future__ import annotations

# Only the standard library here: the console script imports this module before main()
# can put the stop-signal handling in place (see cli.stop_signals); the rest is imported
# by the functions that use it.
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_tiers.cli.stop_signals import command_running, ended_at_start

if TYPE_CHECKING:
    import typer

    from lmcache_tiers.plugins import PluginSet

HELP_OPTION_NAMES = ["-h", "--help"]


def _version(value: bool) -> None:
    import typer

    from lmcache_tiers import __version__

    if value:
        typer.echo(f"lmcache-tiers {__version__}")
        raise typer.Exit()


def build_app(with_plugin_commands: bool = True) -> typer.Typer:
    import typer

    from lmcache_tiers.cli import plugins_cmd, serve_cmd
    from lmcache_tiers.plugins import load_plugins
    from lmcache_tiers.registry import Kind

    plugin_set = load_plugins()
    adapters = ", ".join(plugin_set.registry.names(Kind.L2_ADAPTER)) or "none"
    app = typer.Typer(
        name="lmcache-tiers",
        help="Two-level KV-cache storage server for LLM inference engines.\n\n"
        "L1 is a preallocated CPU-memory arena; L2 is an ordered list of adapters provided by "
        f"plugins (installed here: {adapters}).",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": HELP_OPTION_NAMES},
    )

    def _root(
        ctx: typer.Context,
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """Two-level KV-cache storage server for LLM inference engines."""
        # The command line parsed as far as the command: start-up is over, until the root
        # context closes once the command returned or raised.
        ctx.with_resource(command_running())

    # typer reads the annotations from the module's globals, where typer is not imported
    # (see above): the context's is given as the class itself.
    _root.__annotations__["ctx"] = typer.Context
    app.callback()(_root)

    app.command("serve")(serve_cmd.make_serve(plugin_set))
    app.add_typer(plugins_cmd.app, name="plugins")
    _add_server_commands(app)
    if with_plugin_commands:
        add_plugin_commands(app, plugin_set)
    return app


def add_plugin_commands(app: typer.Typer, plugin_set: PluginSet) -> None:
    """Call each plugin's ``tiers_register_commands`` on its own.

    The hook runs before any argument is parsed, so one plugin raising there would end
    every command, ``plugins list`` and ``--help`` included, with a traceback.  Its
    commands are left out instead: one line on stderr says so, and the plugin is listed
    with the error (``serve --strict`` refuses to start with it).
    """
    from lmcache_tiers.cli.output import warn
    from lmcache_tiers.errors import PluginError
    from lmcache_tiers.plugins import call_each

    # What the app held before each implementation ran: a failing one's commands and
    # groups, those it added before it raised included, are taken out again.
    held: dict[str, int] = {}

    def before(_plugin: str) -> None:
        held.update(commands=len(app.registered_commands), groups=len(app.registered_groups))

    def failed(plugin: str, exc: Exception) -> None:
        del app.registered_commands[held["commands"] :]
        del app.registered_groups[held["groups"] :]
        why = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
        reason = f"its commands failed to register: {why}"
        info = next((p for p in plugin_set.plugins if p.name == plugin), None)
        if info is not None and not info.error:
            info.error, info.commands_only = reason, True
        warn(f"plugin {plugin}: {reason}; they are left out")

    call_each(plugin_set.manager.hook.tiers_register_commands, failed, before, app=app)


def _add_server_commands(app: typer.Typer) -> None:
    """Commands that talk to a running server (present once the server package exists)."""
    try:
        from lmcache_tiers.cli import commands_server
    except ImportError:
        return
    for name in ("status", "bench"):
        function = getattr(commands_server, name, None)
        if function is not None:
            app.command(name)(function)
    from lmcache_tiers.cli import replay_cmd

    app.command("replay", help=replay_cmd.REPLAY_HELP)(replay_cmd.replay)


def command_tree(app: typer.Typer) -> Any:
    """The click command of ``app``, with flags shown without a value placeholder.

    typer's rich help prints a type such as ``<bool>`` next to every on/off flag, including
    ``--help`` and ``--version``, as if they took a value; an empty metavar removes it.
    """
    import typer

    root = typer.main.get_command(app)
    pending = [root]
    while pending:
        command = pending.pop()
        pending.extend(getattr(command, "commands", {}).values())
        context = typer.Context(command, info_name=command.name, help_option_names=HELP_OPTION_NAMES)
        helper = command.get_help_option(context)
        for param in [*command.params, *([helper] if helper is not None else [])]:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
    return root


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: a stop signal from its first instant on is one line."""
    with ended_at_start():
        run(lambda: command_tree(build_app()), argv)


def run(make_command: Callable[[], Any], argv: list[str] | None) -> None:
    """Run the command ``make_command`` builds on ``argv``, every usage and configuration
    error one line on stderr and exit code 2.  (Tests build the command once and run it
    on many inputs.)"""
    import typer
    from typer.exceptions import TyperException

    from lmcache_tiers.cli import lmcache_flags
    from lmcache_tiers.cli.output import EXIT_USAGE, fail
    from lmcache_tiers.errors import TiersError

    try:
        command = make_command()
        result = command.main(args=argv, prog_name="lmcache-tiers", standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except KeyboardInterrupt:  # before the command runs (its plugins load): no traceback
        fail("interrupted (SIGINT) as the command started", 130)
    except TyperException as exc:  # usage errors: bad flag values, unknown options
        show_help = getattr(exc, "show", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and callable(show_help):
            show_help()  # a bare command group prints its help, like --help
            sys.exit(EXIT_USAGE)
        context = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoSuchOption" and getattr(context, "info_name", None) == "serve":
            refused = lmcache_flags.refusal(str(getattr(exc, "option_name", "")))
            if refused is not None:
                fail(refused, EXIT_USAGE)
        fail(exc.format_message(), getattr(exc, "exit_code", EXIT_USAGE))
    except TiersError as exc:
        fail(str(exc), EXIT_USAGE)
    if isinstance(result, int) and result:
        sys.exit(result)


if __name__ == "__main__":
    main()
