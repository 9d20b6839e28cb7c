"""Entry point of the ``lmcache-tiers`` command: builds the typer app and runs it.

Usage errors (bad flag values, unknown options) and configuration errors are turned into
one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer
from typer.exceptions import TyperException

from lmcache_tiers import __version__
from lmcache_tiers.cli.output import EXIT_USAGE, fail
from lmcache_tiers.errors import TiersError


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmcache-tiers {__version__}")
        raise typer.Exit()


def build_app(with_plugin_commands: bool = True) -> typer.Typer:
    from lmcache_tiers.cli import plugins_cmd, serve_cmd

    app = typer.Typer(
        name="lmcache-tiers",
        help="Two-level KV-cache storage server for LLM inference engines.\n\n"
        "L1 is a preallocated CPU-memory arena; L2 is an ordered list of adapters "
        "(NIXL, files, S3, block devices, Redis ...) provided by plugins.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """Two-level KV-cache storage server for LLM inference engines."""

    app.command("serve", help=serve_cmd.SERVE_HELP)(serve_cmd.serve)
    app.add_typer(plugins_cmd.app, name="plugins")
    _add_server_commands(app)
    if with_plugin_commands:
        from lmcache_tiers.plugins import load_plugins

        load_plugins().manager.hook.tiers_register_commands(app=app)
    return app


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


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        command = typer.main.get_command(build_app())
        result = command.main(args=argv, prog_name="lmcache-tiers", standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except TyperException as exc:  # usage errors: bad flag values, unknown options
        show_help = getattr(exc, "show", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and callable(show_help):
            show_help()  # a bare command group prints its help, like --help
            sys.exit(EXIT_USAGE)
        fail(exc.format_message(), getattr(exc, "exit_code", EXIT_USAGE))
    except TiersError as exc:
        fail(str(exc), EXIT_USAGE)
    if isinstance(result, int) and result:
        sys.exit(result)


if __name__ == "__main__":
    main()
