"""``lmcache-tiers replay TRACE``: replay a Mooncake trace through a server, through an
in-process StorageManager, or against a simulation of every eviction policy.

A plain function with typer-annotated parameters; heavy imports happen inside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Optional

import typer

from lmcache_tiers.cli.commands_server import MAX_TIMEOUT_S, WAIT_TIMEOUT_HELP, client_token, server_url
from lmcache_tiers.cli.output import fail, stderr, stdout
from lmcache_tiers.cli.stop_signals import signalled
from lmcache_tiers.config import ServerConfig
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.replay.trace import REPLAY_MODEL, REPLAY_SALT

REPLAY_HELP = (
    "Replay a Mooncake trace (one JSON object per line: timestamp in ms, input_length, "
    "output_length, hash_ids of 512-token blocks) and report prefix hit rates.\n\n"
    "Three modes: through a running server (--url, the default), in this process against a "
    "StorageManager built from serve's L1/L2 flags (--in-process), or with no server at all "
    "(--simulate): the miss-ratio curve of exact LRU, every installed eviction policy, "
    "Belady's optimum and an infinite cache; --foresight and --retime add oracles that show what "
    "knowing the future is worth.\n\n"
    "Replay keys carry their own model name and salt, so a replay never touches an engine's data."
)

DEFAULT_URL = "tcp://127.0.0.1:5555"
#: the most reads of a hit prefix per request a simulation takes (an engine takes two or three)
MAX_READS_PER_HIT = 64
#: the most --clients: each is a Python process of its own (some 50 MB before its buffers),
#: and a mistyped count (a million) would otherwise fork until the machine ran out of memory
MAX_CLIENTS = 256
#: the widest --retime-bandwidth, in requests: far wider than any trace, and still a float
MAX_RETIME_BANDWIDTH = 1 << 53

_D = ServerConfig()

#: the modes of a replay, as an error names them
SIMULATE, IN_PROCESS, SERVER = "--simulate", "--in-process", "a replay through a server (--url)"
#: replay parameter -> the modes it does something in (the rest apply to every mode)
_MODES_OF: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "capacity",
            "l2_capacity",
            "policy",
            "l2_policy",
            "reads_per_hit",
            "plot",
            "foresight",
            "retime",
            "retime_bandwidth",
        ),
        (SIMULATE,),
    ),
    **dict.fromkeys(("time_scale", "timeout", "model", "salt"), (IN_PROCESS, SERVER)),
    **dict.fromkeys(("clients", "auth_token"), (SERVER,)),
    **dict.fromkeys(
        (
            "l1_blocks",
            "l1_size_gb",
            "eviction_policy",
            "l2_adapter",
            "l2_store_policy",
            "l2_prefetch_policy",
            "l2_prefetch_max_in_flight",
            "gds_l1_path",
            "config",
        ),
        (IN_PROCESS,),
    ),
    **dict.fromkeys(("eviction_trigger_watermark", "eviction_ratio"), (SIMULATE, IN_PROCESS)),
}


def _refuse_other_modes(ctx: typer.Context, mode: str) -> None:
    """An option given on the command line that does nothing in ``mode`` is an error, not
    silently ignored (one from the environment, such as the auth token, is not)."""
    for param in ctx.command.params:
        modes = _MODES_OF.get(param.name or "")
        if modes is None or mode in modes:
            continue
        source = ctx.get_parameter_source(param.name or "")
        if source is not None and source.name == "COMMANDLINE":
            where = " and ".join(modes)
            fail(f"{param.opts[0]} applies only to {where}, not to {mode}")


def _finite_in(low: float, high: float | None = None) -> Callable[[Any], float]:
    """Parser of a float option that must be finite and within [low, high].  typer checks
    an option's ``min``/``max`` before any callback, and said of nan, which is neither
    below nor above a bound, "Input should be greater than or equal to 0"; with a parser it
    shows ``min``/``max`` in the help and leaves the checks to it."""

    def parse(raw: Any) -> float:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{raw!r} is not a number") from None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{raw} is not a finite number")
        if value < low:
            raise typer.BadParameter(f"Input should be greater than or equal to {low:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"Input should be less than or equal to {high:g}")
        return value

    return parse


class _Step:
    """What the command is doing, for the line a signal that ends it prints: outside the
    replay proper (which reports what it measured) Ctrl-C printed an empty line and SIGTERM
    nothing at all, and the operator could not tell what was cut short."""

    def __init__(self) -> None:
        self.now = "starting"
        self.left = "nothing was replayed"

    def __call__(self, now: str, left: str | None = None) -> None:
        self.now = now
        if left is not None:
            self.left = left


@contextlib.contextmanager
def _ended_by_signal(step: _Step) -> Iterator[None]:
    """SIGTERM and Ctrl-C unwind the command wherever they come (the replay proper puts its
    own handlers in place while it runs, and reports what it measured); where that prints
    nothing, one line names the signal and ``step``, and the exit code is 128 + the signal.
    Later signals are ignored while it unwinds, which takes no time outside the replay."""
    try:
        # Inside: loading the replay's modules takes a moment, and Ctrl-C there ended the
        # command with exit 130 and not a word (typer's own handling of KeyboardInterrupt).
        from lmcache_tiers.replay.server import signals_unwind

        with signals_unwind():
            yield
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, KeyboardInterrupt):
            signum: int | None = signal.SIGINT  # only Ctrl-C raises it, maybe before the import
        else:
            signum = signalled(exc)
        if signum is None:
            raise  # an error whose line is printed already
        fail(f"interrupted ({signal.Signals(signum).name}) while {step.now}; {step.left}", 128 + signum)


def _split(values: list[str] | None, flag: str | None = None) -> list[str]:
    parts = [part.strip() for value in values or [] for part in value.split(",") if part.strip()]
    if flag is not None and values and not parts:
        # An empty value (an unset variable) is a mistake, not a request for the defaults.
        raise ConfigError(f"{flag} {values[0]!r} names nothing; leave it out for the default")
    return parts


def replay(
    ctx: typer.Context,
    trace_file: Annotated[str, typer.Argument(metavar="TRACE", help="Mooncake trace file (JSON lines).")],
    simulate: Annotated[bool, typer.Option("--simulate", help="No server: simulate every policy.")] = False,
    in_process: Annotated[
        bool, typer.Option("--in-process", help="Replay against a StorageManager in this process.")
    ] = False,
    url: Annotated[
        Optional[str],
        typer.Option(
            "--url", callback=server_url, help=f"Server to replay through. \\[default: {DEFAULT_URL}]"
        ),
    ] = None,
    limit: Annotated[
        Optional[int],
        typer.Option(min=1, help="Replay only the first N requests. \\[default: every request]"),
    ] = None,
    block_bytes: Annotated[
        int, typer.Option(min=128, help="Bytes per block (also converts byte capacities to blocks).")
    ] = 16 << 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    # -- simulation -------------------------------------------------------------------
    capacity: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Simulated L1 capacity: whole blocks (1000, 4k) or bytes (512MiB); repeat or "
            "comma-separate. \\[default: powers of two from 256 blocks up to the trace's working set]"
        ),
    ] = None,
    l2_capacity: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Simulated L2 capacity, one per --capacity (a two-tier point each). "
            "\\[default: none, L1 alone]"
        ),
    ] = None,
    policy: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Eviction policies to simulate; repeat for several. \\[default: every installed one]"
        ),
    ] = None,
    l2_policy: Annotated[str, typer.Option(help="Eviction policy of the simulated L2.")] = "LRU",
    reads_per_hit: Annotated[
        int,
        # bounded: the simulation repeats each read, so a huge count would run for ever
        typer.Option(
            min=1, max=MAX_READS_PER_HIT, help="Reads of each hit prefix per request (LOOKUP + RETRIEVE = 2)."
        ),
    ] = 2,
    plot: Annotated[
        Optional[str],
        typer.Option(
            help="Also draw the miss-ratio curve into this file; its extension (.png, .svg or .pdf) "
            "is the format, nothing is appended. \\[default: none]",
        ),
    ] = None,
    foresight: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Add an oracle told each block's next use within H requests ('all': unlimited); "
            "repeat or comma-separate. \\[default: none]"
        ),
    ] = None,
    retime: Annotated[
        Optional[int],
        typer.Option(
            min=0,
            help="Simulate a re-timed sample (this seed) of the trace's Poisson model instead, with "
            "the rate oracle and the bound no online policy beats on it. "
            "\\[default: none, the trace as recorded]",
        ),
    ] = None,
    retime_bandwidth: Annotated[
        Optional[int],
        # bounded: it is used as a float (and a bandwidth past the trace's length is flat)
        typer.Option(
            min=1,
            max=MAX_RETIME_BANDWIDTH,
            help="Rate smoothing of --retime, in requests. \\[default: the likeliest]",
        ),
    ] = None,
    # -- real bytes -------------------------------------------------------------------
    time_scale: Annotated[
        float,
        typer.Option(
            min=0.0,
            parser=_finite_in(0.0),
            help="Replay seconds per trace second; 0 sends as fast as possible.",
        ),
    ] = 0.0,
    clients: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_CLIENTS,
            help="Client processes sharing the requests (server mode), each a Python process of its own.",
        ),
    ] = 1,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.01,
            max=MAX_TIMEOUT_S,
            parser=_finite_in(0.01, MAX_TIMEOUT_S),
            # in-process there is no reply: it bounds the waits for L2 that replace them
            help=f"{WAIT_TIMEOUT_HELP[:-1]}; in-process, for each L2 load and for the L2 stores "
            "still in flight at the end.",
        ),
    ] = 60.0,
    auth_token: Annotated[
        Optional[str],
        typer.Option(
            envvar="LMCACHE_TIERS_AUTH_TOKEN",
            callback=client_token,
            help="Token, if the server requires one. \\[default: none]",
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="Model name of replay keys.")] = REPLAY_MODEL,
    salt: Annotated[str, typer.Option(help="Cache salt of replay keys.")] = REPLAY_SALT,
    # -- in-process: serve's flags ------------------------------------------------------
    l1_blocks: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help="In-process L1 of exactly N blocks that never starts background eviction. "
            "\\[default: none, --l1-size-gb sizes L1]",
        ),
    ] = None,
    l1_size_gb: Annotated[
        Optional[float],
        typer.Option(help=f"In-process L1 arena size in GiB. \\[default: {_D.l1_size_gb}]"),
    ] = None,
    eviction_policy: Annotated[
        Optional[str], typer.Option(help=f"In-process L1 eviction policy. \\[default: {_D.eviction_policy}]")
    ] = None,
    eviction_trigger_watermark: Annotated[
        Optional[float],
        typer.Option(
            help="L1 usage that starts background eviction (in-process; in --simulate: off unless set). "
            f"\\[default: {_D.eviction_trigger_watermark} in-process, 1.0 with --l1-blocks]"
        ),
    ] = None,
    eviction_ratio: Annotated[
        Optional[float],
        typer.Option(
            help="Fraction of allocated L1 freed per background round (in --simulate: only with "
            f"--eviction-trigger-watermark). \\[default: {_D.eviction_ratio}]"
        ),
    ] = None,
    l2_adapter: Annotated[
        Optional[list[str]],
        typer.Option(
            help='In-process L2 adapter as JSON with a "type"; repeat for a cascade. '
            "\\[default: none, never serve's embedded default L2]"
        ),
    ] = None,
    l2_store_policy: Annotated[
        Optional[str], typer.Option(help=f"In-process store policy. \\[default: {_D.l2_store_policy}]")
    ] = None,
    l2_prefetch_policy: Annotated[
        Optional[str], typer.Option(help=f"In-process prefetch policy. \\[default: {_D.l2_prefetch_policy}]")
    ] = None,
    l2_prefetch_max_in_flight: Annotated[
        Optional[int],
        typer.Option(help=f"In-process prefetches in flight. \\[default: {_D.l2_prefetch_max_in_flight}]"),
    ] = None,
    gds_l1_path: Annotated[
        Optional[str], typer.Option(help="In-process NVMe L1 directory. \\[default: none, L1 in memory]")
    ] = None,
    config: Annotated[
        Optional[str],
        typer.Option("--config", help="TOML file with serve's keys (in-process). \\[default: none]"),
    ] = None,
) -> None:
    from lmcache_tiers.errors import TiersError

    step = _Step()
    with _ended_by_signal(step):
        from lmcache_tiers.replay.run import check_pacing

        _check_stdout()
        modes = [
            name
            for name, chosen in (("--simulate", simulate), ("--in-process", in_process), ("--url", url))
            if chosen
        ]
        if len(modes) > 1:
            fail(f"choose one of --simulate, --in-process and --url, not {' and '.join(modes)}")
        _refuse_other_modes(ctx, SIMULATE if simulate else IN_PROCESS if in_process else SERVER)
        try:
            step(f"reading the trace {trace_file}")
            trace = _read_trace(trace_file, limit)
            step("checking the options")
            if simulate:
                _simulate(
                    step,
                    trace,
                    capacity,
                    l2_capacity,
                    policy,
                    l2_policy,
                    reads_per_hit,
                    block_bytes,
                    eviction_trigger_watermark,
                    eviction_ratio,
                    plot,
                    as_json,
                    _analysis_options(foresight, retime, retime_bandwidth),
                )
                return
            options = _options(block_bytes, time_scale, timeout, model, salt)
            # Here, not only in the replay: the server replay runs outside this try.
            check_pacing(trace, options.time_scale)
            if in_process:
                overrides = {
                    "l1_size_gb": l1_size_gb,
                    "eviction_policy": eviction_policy,
                    "eviction_trigger_watermark": eviction_trigger_watermark,
                    "eviction_ratio": eviction_ratio,
                    "l2_store_policy": l2_store_policy,
                    "l2_prefetch_policy": l2_prefetch_policy,
                    "l2_prefetch_max_in_flight": l2_prefetch_max_in_flight,
                    "gds_l1_path": gds_l1_path,
                }
                _in_process(step, trace, options, config, overrides, l2_adapter, l1_blocks, as_json)
                return
        except TiersError as exc:
            fail(str(exc))
        _server(step, trace, options, url or DEFAULT_URL, clients, auth_token, as_json)


def _analysis_options(foresight: list[str] | None, seed: int | None, bandwidth: int | None) -> Any:
    from lmcache_tiers.replay.analysis import AnalysisOptions
    from lmcache_tiers.replay.foresight import parse_horizons

    try:
        horizons = parse_horizons(_split(foresight, "--foresight"))
    except ValueError as exc:
        raise ConfigError(f"--foresight: {exc}") from None
    if bandwidth is not None and seed is None:
        raise ConfigError("--retime-bandwidth needs --retime SEED")
    return AnalysisOptions(foresight=horizons, retime_seed=seed, retime_bandwidth=bandwidth)


def _options(block_bytes: int, time_scale: float, timeout: float, model: str, salt: str) -> Any:
    from lmcache_tiers.errors import KeyValidationError
    from lmcache_tiers.replay.run import ReplayOptions
    from lmcache_tiers.replay.trace import KeySpace

    options = ReplayOptions(
        block_bytes=block_bytes, time_scale=time_scale, timeout_s=timeout, model=model, salt=salt
    )
    # A bad model name or salt fails here, as one line naming the flag (the key's field
    # names, model_name and cache_salt, are not what the user typed).
    for flag, names in (("--model", (model, REPLAY_SALT)), ("--salt", (REPLAY_MODEL, salt))):
        try:
            KeySpace(*names)
        except KeyValidationError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    return options


def _progress(in_bytes: bool = False) -> Any:
    """A transient progress bar on stderr, so the report on stdout (``--json`` too) stays
    clean; none when stderr is no terminal (a log file got an empty line from each bar)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        DownloadColumn() if in_bytes else MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal,
        refresh_per_second=4,
    )


def _read_trace(path: str, limit: int | None) -> Any:
    """The trace, with a progress bar in bytes: a trace of gigabytes takes minutes to read."""
    from lmcache_tiers.replay.trace import read_trace

    try:
        size = os.stat(path).st_size if os.path.isfile(path) else None
    except OSError:
        size = None  # read_trace names what is wrong with the file
    progress = _progress(in_bytes=True)
    with progress:
        task = progress.add_task("reading the trace", total=size or None)
        return read_trace(path, limit, progress=lambda n: progress.update(task, advance=n))


def _simulate(
    step: _Step,
    trace: Any,
    capacity: list[str] | None,
    l2_capacity: list[str] | None,
    policy: list[str] | None,
    l2_policy: str,
    reads_per_hit: int,
    block_bytes: int,
    watermark: float | None,
    eviction_ratio: float | None,
    plot: str | None,
    as_json: bool,
    analysis_options: Any,
) -> None:
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.registry import Kind
    from lmcache_tiers.replay.analysis import prepare
    from lmcache_tiers.replay.capacity import extent_bytes, parse_capacity
    from lmcache_tiers.replay.report import (
        bound_table,
        curve_table,
        gap_table,
        simulation_document,
        timing_table,
    )
    from lmcache_tiers.replay.simulate import (
        TierSettings,
        default_capacities,
        policy_factories,
        simulate_curve,
    )

    if plot is not None:
        from lmcache_tiers.replay.plot import check_plot_path

        check_plot_path(plot)  # before the simulation, which may take minutes
    registry = load_registry()
    extent = extent_bytes(block_bytes, 4096)
    l1_specs, l2_specs = _split(capacity, "--capacity"), _split(l2_capacity, "--l2-capacity")
    capacities = [parse_capacity(spec).in_blocks(extent) for spec in l1_specs] or default_capacities(trace)
    l2_capacities: list[int | None] | None = None
    if l2_specs:
        if len(l2_specs) != len(capacities) and not l1_specs:
            # the operator gave no --capacity: name the defaults the count is held against
            raise ConfigError(
                f"give one --l2-capacity per L1 capacity: got {len(l2_specs)} for the "
                f"{len(capacities)} default capacities ({', '.join(f'{c:,}' for c in capacities)} "
                "blocks); give --capacity too"
            )
        if len(l2_specs) != len(capacities):
            raise ConfigError(
                f"give one --l2-capacity per --capacity ({len(capacities)}), got {len(l2_specs)}"
            )
        l2_capacities = [parse_capacity(spec).in_blocks(extent) for spec in l2_specs]
    for blocks in [*capacities, *(l2_capacities or [])]:
        if blocks is not None and blocks < 1:
            raise ConfigError(f"a capacity of {blocks} blocks of {block_bytes} bytes holds nothing")
    if watermark is not None and not 0.0 < watermark <= 1.0:
        raise ConfigError(f"--eviction-trigger-watermark must be in (0, 1], got {watermark}")
    if eviction_ratio is not None and watermark is None:
        # what a background round frees, and a simulation runs none without a watermark
        raise ConfigError(
            "--eviction-ratio does nothing in --simulate without --eviction-trigger-watermark "
            "(background eviction is off unless that is given): give that too, or leave --eviction-ratio out"
        )
    ratio = 0.2 if eviction_ratio is None else eviction_ratio
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"--eviction-ratio must be in (0, 1], got {ratio}")
    # Policy names before the analysis, which re-times a long trace for minutes.
    policies = policy_factories(registry, _split(policy, "--policy") or None)
    l2_component = registry.get(Kind.EVICTION_POLICY, l2_policy)
    l2_factory = policy_factories(registry, [l2_component.name])[l2_component.name]
    if analysis_options.retime_seed is None:
        analysis = prepare(trace, analysis_options)
    else:
        # about a minute per 100,000 requests, before the simulation's own bar
        step("re-timing the trace (--retime)", "no report: the simulation had not started")
        with _progress() as waiting:
            waiting.add_task("re-timing the trace", total=None)
            analysis = prepare(trace, analysis_options)
    trace = analysis.trace
    factories = {**policies, **analysis.factories}
    settings = TierSettings(
        reads_per_hit=reads_per_hit,
        trigger_watermark=watermark,
        eviction_ratio=ratio,
        l2_policy=l2_component.name,
    )
    step("simulating", "no report: the simulation was cut short")
    progress = _progress()
    with progress:
        task = progress.add_task("simulating", total=len(capacities) * (len(factories) + 1))

        def advance(label: str, finished: int) -> None:
            progress.update(task, completed=finished, description=label)

        points = simulate_curve(
            trace,
            factories,
            capacities,
            l2_capacities=l2_capacities,
            settings=settings,
            l2_factory=l2_factory,
            progress=advance,
        )
        bounds = analysis.online_bound(
            [point.capacity_blocks + (point.l2_capacity_blocks or 0) for point in points]
        )
    title = f"miss ratio on {trace.path} ({len(trace.requests):,} requests, lower is better)"
    if plot:
        from lmcache_tiers.replay.plot import plot_curve

        step(f"writing the plot {plot}", "no report, and no plot written")
        plot_curve(points, plot, title=f"miss ratio: {trace.path.rsplit('/', 1)[-1]}")
    step("printing the report", "the report above is cut short")
    with _writing_report():
        if as_json:
            document = simulation_document(
                trace, points, settings, analysis=analysis.describe(), bounds=bounds
            )
            if plot:
                document["plot"] = plot
            typer.echo(json.dumps(document, indent=2))
            return
        _print_table(curve_table(points, title=title, oracles=analysis.oracles))
        gaps = gap_table(points)
        if gaps is not None:
            _print_table(gaps)
        if bounds is not None:
            _print_table(bound_table(points, bounds))
        _print_table(timing_table(points, trace))
        conflicts = trace.chain_conflicts()
        if conflicts:
            stdout.print(
                f"[yellow]note:[/] {conflicts} blocks appear after two different parents; "
                "Belady is an upper bound there"
            )
        if plot:
            stdout.print(f"plot written to {plot}")


def _in_process(
    step: _Step,
    trace: Any,
    options: Any,
    config_file: str | None,
    overrides: dict[str, Any],
    l2_adapter: list[str] | None,
    l1_blocks: int | None,
    as_json: bool,
) -> None:
    from lmcache_tiers.cli.serve_cmd import ConfigFile, config_file_values, name_flag
    from lmcache_tiers.config import build_config
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.replay.capacity import l1_size_for_blocks
    from lmcache_tiers.replay.inprocess import ReplayCloseFailed, replay_in_process
    from lmcache_tiers.replay.run import ReplayStopped
    from lmcache_tiers.replay.server import signals_unwind
    from lmcache_tiers.server.app import check_l1_geometry

    registry = load_registry()
    # An empty --config (an unset variable) is a missing file, not "no file".  Read as serve
    # reads it: a mistake of the file's own (an unknown key) names the file.
    file_values = config_file_values(config_file) if config_file is not None else {}
    given = {name for name, value in overrides.items() if value is not None}  # serve's flag names
    named_file = ConfigFile.of(config_file, file_values, ["l2_adapters"] if l2_adapter else [])
    if l1_blocks is not None:
        if overrides.get("l1_size_gb") is not None:
            raise ConfigError("give --l1-blocks or --l1-size-gb, not both")
        # --l1-blocks sets both: a config file's values would be dropped without a word
        from_file = [name for name in ("l1_size_gb", "l1_align_bytes") if name in file_values]
        if from_file:
            raise ConfigError(
                f"--l1-blocks sets the L1's size and alignment itself, and --config {config_file} "
                f"gives {' and '.join(from_file)}: leave {'them' if len(from_file) > 1 else 'it'} "
                "out of the file, or --l1-blocks off"
            )
        size_gb, align = l1_size_for_blocks(l1_blocks, options.block_bytes)
        overrides["l1_size_gb"] = size_gb
        overrides["l1_align_bytes"] = align
        if overrides.get("eviction_trigger_watermark") is None:
            overrides["eviction_trigger_watermark"] = 1.0
    # Never the embedded default L2 (it lives in the user's cache directory): replay data
    # goes only where the flags or the config file say.
    try:
        config = build_config(registry, file_values, overrides, l2_adapter)
    except ConfigError as exc:
        raise name_flag(exc, given, config_file=named_file) from None
    # serve's checks of the L1 it cannot build, before the progress bar starts building it
    try:
        check_l1_geometry(config)
    except ConfigError as exc:
        raise name_flag(exc, given, config_file=named_file) from None
    if options.block_bytes > config.l1_size_bytes:
        # Refused before the replay allocates a buffer of one block, which may not fit in memory.
        raise ConfigError(
            f"--block-bytes {options.block_bytes}: larger than the L1 (--l1-size-gb "
            f"{config.l1_size_gb:g}), which could hold no block; give smaller blocks or a larger L1"
        )
    # A signal before the replay's first request (here, as the L1 arena is pre-faulted) has
    # no report to print: the storage built so far is closed, its arena removed.
    step("building the in-process storage (pre-faulting its L1)")
    progress = _progress()
    # SIGTERM exits through the StorageManager's close as Ctrl-C does: under Python's default
    # action it ended the process at once, leaving the L1 arena in /dev/shm.
    try:
        with progress, signals_unwind():
            task = progress.add_task("replaying (in-process)", total=len(trace.requests))
            report = replay_in_process(
                config, trace, options, registry=registry, progress=lambda n: progress.update(task, advance=n)
            )
    except ReplayCloseFailed as failed:
        # The replay ran to its end: its report first, then the close's failure (exit 1, a
        # failure at the end -- not the usage error every other TiersError here is).
        _show(step, failed.report.to_dict(), as_json, also_failed=str(failed))
        return
    except ReplayStopped as stopped:
        # Ctrl-C or SIGTERM: what was measured until then, then why it is partial.
        _show(step, stopped.report.to_dict(), as_json, also_failed=str(stopped), code=stopped.exit_code)
        return
    _show(step, report.to_dict(), as_json)


def _server(
    step: _Step, trace: Any, options: Any, url: str, clients: int, auth_token: str | None, as_json: bool
) -> None:
    from lmcache_tiers.cli.connect import wait_for_server
    from lmcache_tiers.client import ClientError
    from lmcache_tiers.replay.run import ReplayStopped
    from lmcache_tiers.replay.server import replay_server

    progress = _progress()
    try:
        step(f"waiting for the server at {url}")
        wait_for_server(url, timeout=options.timeout_s, auth_token=auth_token)
        _check_block_fits(url, options, auth_token)
        step(f"starting the replay through {url}")
        with progress:
            task = progress.add_task(f"replaying via {url}", total=len(trace.requests))
            report = replay_server(
                url,
                trace,
                options,
                clients=clients,
                auth_token=auth_token,
                progress=lambda n: progress.update(task, advance=n),
            )
    except ReplayStopped as stopped:
        # What was measured before the end came is worth showing: the report, then why it
        # is partial, with the exit code of its cause.
        _show(step, stopped.report.to_dict(), as_json, also_failed=str(stopped), code=stopped.exit_code)
        return
    except ClientError as exc:
        fail(f"replay through {url} failed: {exc}", 1)
    except ConfigError as exc:
        fail(str(exc))  # refused before any request, as in-process: a block that does not fit in memory
    _show(step, report.to_dict(), as_json)


def _check_block_fits(url: str, options: Any, auth_token: str | None) -> None:
    """Refuse blocks the server's L1 could never hold, before each client process allocates
    buffers of several blocks (which may not fit in this machine's memory)."""
    from lmcache_tiers.client import Client

    with Client(url, auth_token=auth_token, timeout=options.timeout_s, shm=False, name="replay") as client:
        capacity = int(client.status().get("l1", {}).get("capacity_bytes", 0))
    if capacity and options.block_bytes > capacity:
        fail(
            f"--block-bytes {options.block_bytes}: larger than the L1 of {url} ({capacity} bytes), "
            "which could hold no block; give smaller blocks"
        )


def _check_stdout() -> None:
    """Refuse, before any work, a stdout the report cannot be written to: closed (``>&-``;
    the report was lost without a word, exit 0) or open for reading only (a traceback once
    the work was done)."""
    if sys.stdout is None:
        fail("stdout is closed, and the report is written there; give it a file or a pipe")
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return  # no file descriptor: a caller that captures the output in memory
    try:
        writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError as exc:
        fail(f"stdout cannot be written ({exc.strerror or exc}), and the report is written there")
    if not writable:
        fail("stdout is open for reading only, and the report is written there; give it a file or a pipe")


@contextlib.contextmanager
def _writing_report() -> Iterator[None]:
    """One line and exit 1, not a traceback, when the report cannot be written whole (a full
    disk; a reader that went away ends it quietly, exit 1); stdout then goes to /dev/null, so
    that the interpreter's last flush does not fail again."""
    try:
        yield
        sys.stdout.flush()  # a full disk may only show here
    except OSError as exc:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        if exc.errno == errno.EPIPE:
            sys.exit(1)  # the reader stopped reading (``| head``): quiet, as rich's tables end
        fail(f"cannot write the report to stdout: {exc.strerror or exc}", 1)


def _print_table(table: Any) -> None:
    """A terminal shrinks wide tables to fit; a pipe or file gets them whole.  Rich caps a
    width given to ``print`` at the console's (80 columns, or $COLUMNS, off a terminal),
    so a console as wide as the table prints it there: cut to 80 columns, a miss ratio
    read "0.97…" in a saved report."""
    if stdout.is_terminal:
        stdout.print(table)
        return
    from rich.console import Console
    from rich.measure import Measurement

    needs = Measurement.get(stdout, stdout.options.update(width=1 << 16), table)
    # Up to 200 columns as the table likes, wider only where less would cut a word.
    width = max(stdout.width, min(needs.maximum, 200), needs.minimum)
    Console(file=stdout.file, highlight=False, soft_wrap=True, width=width).print(table)


def _show(
    step: _Step, document: dict[str, Any], as_json: bool, also_failed: str | None = None, code: int = 1
) -> None:
    """Print the report; then one error line and exit ``code`` (1 unless a signal's) when a
    retrieved block was corrupt or ``also_failed`` names what ended the replay or failed
    after it (both, when both happened)."""
    from lmcache_tiers.replay.report import replay_table

    step("printing the report", "the report above is cut short")
    with _writing_report():
        if as_json:
            typer.echo(json.dumps(document, indent=2))
        else:
            _print_table(replay_table(document))
    failures = [also_failed] if also_failed else []
    if document["corrupt_blocks"]:
        failures.insert(0, f"{document['corrupt_blocks']} retrieved blocks did not hold their own bytes")
    if failures:
        fail("; ".join(failures), code)
