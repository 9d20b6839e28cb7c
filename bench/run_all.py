"""Every benchmark of the project in one run, written as one report (markdown + JSON).

Each benchmark runs in its own process with ``--json`` (no text is scraped) and quick but
meaningful sizes (``--full``: each benchmark's own defaults); every figure in the report
is one that benchmark measured next to its limit in the same run:

* the server's data plane next to memcpy, and lookups/s next to a bare ZeroMQ round trip
  (``bench_server``); the reference's workload shape through our client, warm, with fresh
  clients and with L2 write-back (``bench_workload``, the L2 with O_DIRECT as the docs advise);
* each L2 adapter next to raw I/O of the same bytes (``bench_nixl``, ``bench_fs``,
  ``bench_block``, ``bench_redis``, ``bench_mooncake``, ``bench_s3``), serdes
  (``bench_serde``), the engine with mock adapters, leases, CLI start-up;
* replay hit rates next to the LRU simulation and Belady's optimum (``bench_replay``);
* when the reference venv exists (``--reference-venv``, LMCache 0.5.6), the reference's
  own server benchmark against both servers on the same sizes, both file L2s with O_DIRECT
  (``bench_lmcache_mp``), and
  its L2 benchmark next to our ``fs`` adapter (``bench_fs``'s reference part).

A benchmark that cannot run here (a missing server binary, no reference venv) is listed
with the reason instead of its figures; the others still run.  ``uptime``'s load average
is recorded before and after, since the machine may be shared.

    python bench/run_all.py                         # writes bench-report.md and bench-report.json
    python bench/run_all.py --only server,workload --out /tmp/report
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_args import BenchParser

BENCH_DIR = Path(__file__).resolve().parent
#: where scripts/install_reference_lmcache.sh installs LMCache 0.5.6 (LMCACHE_REF_VENV moves it)
DEFAULT_REFERENCE = Path(
    os.environ.get(
        "LMCACHE_REF_VENV",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmcache-tiers" / "lmcache-0.5.6",
    )
)


#: how long a timed-out benchmark's processes get to clean up after SIGINT
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    quick: tuple[str, ...] = ()
    needs_reference: bool = False
    timeout_s: float = 1800.0


BENCHES = (
    Bench("server", "bench_server.py", ("--chunks", "32", "--lookup-requests", "5000")),
    Bench("workload", "bench_workload.py", ("--rounds", "12", "--direct")),
    Bench("nixl", "bench_nixl.py", ("--cases", "64x1,16x16", "--repeat", "5")),
    Bench(
        "fs",
        "bench_fs.py",
        ("--parts", "throughput,scan", "--cases", "64x1,16x16", "--scan-objects", "20000"),
    ),
    Bench("block", "bench_block.py", ("--repeat", "3")),
    Bench("redis", "bench_redis.py", ("--repeat", "3")),
    Bench("mooncake", "bench_mooncake.py", ("--repeat", "3")),
    Bench("s3", "bench_s3.py", ("--repeat", "3")),
    Bench("serde", "bench_serde.py", ("--repeat", "3")),
    Bench("engine", "bench_engine.py", ("--prompts", "16")),
    Bench("leases", "bench_leases.py", ("--repeats", "10")),
    Bench("cli_startup", "bench_cli_startup.py", ("--runs", "3")),
    Bench("replay", "bench_replay.py", ("--capacities", "1000,4000", "--seeds", "1")),
    # File L2s with O_DIRECT on both servers: the configuration the docs give operators
    Bench("reference_server", "bench_lmcache_mp.py", ("--slices", "8", "--direct"), needs_reference=True),
    Bench(
        "reference_l2",
        "bench_fs.py",
        ("--parts", "reference", "--ref-keys", "64", "--repeat", "3"),
        needs_reference=True,
    ),
)


@dataclass
class Outcome:
    name: str
    command: list[str]
    seconds: float = 0.0
    figures: Any = None
    skipped: str = ""
    error: str = ""
    stderr_tail: str = field(default="", repr=False)


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def last_json(stdout: str) -> Any:
    """The JSON document a benchmark printed last (some print progress lines before it)."""
    text = stdout.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for start in (
        index for index, char in enumerate(text) if char in "[{" and (index == 0 or text[index - 1] == "\n")
    ):
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON document in the benchmark's output")


def stop_group(process: subprocess.Popen[str]) -> None:
    """Interrupt the process group of ``process`` (SIGINT: Python runs its finally blocks),
    and kill what is left of it after STOP_GRACE_S."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)  # what did not stop in time, children included
    except ProcessLookupError:
        pass
    process.communicate()


def interruptible() -> None:
    """``preexec_fn`` of a benchmark: SIGINT at its default action.  A process started with
    SIGINT ignored (run_all as a script's background job, or under a CI runner that ignores
    it) passes that on, and Python then never raises KeyboardInterrupt -- the SIGINT of
    :func:`stop_group` would skip every clean-up it exists for."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_bench(bench: Bench, full: bool, reference: Path) -> Outcome:
    command = [sys.executable, str(BENCH_DIR / bench.script), *(() if full else bench.quick), "--json"]
    if bench.script == "bench_fs.py":
        command += ["--reference-venv", str(reference)]
    outcome = Outcome(bench.name, command)
    if bench.needs_reference and not (reference / "bin" / "lmcache").exists():
        outcome.skipped = (
            f"the reference venv {reference} has no lmcache (scripts/install_reference_lmcache.sh)"
        )
        return outcome
    env = {**os.environ, "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}
    began = time.perf_counter()
    # Its own process group: on a timeout the benchmark and every process it started (a
    # server, a redis-server, a weed) are interrupted together, so that each one's own
    # clean-up (finally blocks, atexit: servers stopped, /dev/shm segments and temp dirs
    # removed) runs; killing the benchmark alone would leave them all behind.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=BENCH_DIR.parent,
        start_new_session=True,
        preexec_fn=interruptible,
    )
    try:
        stdout, stderr = process.communicate(timeout=bench.timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process)
        outcome.error = f"did not finish within {bench.timeout_s:.0f} s"
        return outcome
    except BaseException:
        # A Ctrl-C at the terminal reaches run_all only (the benchmark has a session of its
        # own): the benchmark and its servers are stopped with it, not left running.
        stop_group(process)
        raise
    outcome.seconds = time.perf_counter() - began
    outcome.stderr_tail = stderr[-2000:]
    if process.returncode != 0:
        last = (stderr.strip() or stdout.strip()).splitlines()[-1:] or [""]
        outcome.error = f"exit {process.returncode}: {last[0][:300]}"
        return outcome
    try:
        outcome.figures = last_json(stdout)
    except ValueError as exc:
        outcome.error = str(exc)
    return outcome


# -- the report ------------------------------------------------------------------------------


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def _records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


def tables_of(figures: Any, title: str = "") -> list[tuple[str, list[dict[str, Any]]]]:
    """Every table in ``figures`` as (title, rows): a list of records as is, a record as one
    row, nested records flattened one level (``a.b``); a list of records inside a record
    (a benchmark's cases, a comparison's rows) is a table of its own, titled by its path,
    each row led by the fields naming its parent when there are several parents; long lists
    (raw samples) are left to the JSON report."""
    items = figures if isinstance(figures, list) else [figures]
    rows: list[dict[str, Any]] = []
    nested: dict[str, list[dict[str, Any]]] = {}  # by title: the rows of every parent, in order
    for item in items:
        if not isinstance(item, dict):
            rows.append({"value": item})
            continue
        row: dict[str, Any] = {}
        inner: list[tuple[str, Any]] = []
        for key, value in item.items():
            if _scalar(value):
                row[key] = value
            elif _records(value):
                inner.append((key, value))
            elif isinstance(value, dict):
                for name, part in value.items():
                    if _scalar(part):
                        row[f"{key}.{name}"] = part
                    elif _records(part) or isinstance(part, dict):
                        inner.append((f"{key}.{name}", part))
            elif isinstance(value, list) and len(value) <= 4 and all(_scalar(v) for v in value):
                row[key] = " / ".join(_cell(v) for v in value)
        rows.append(row)
        for key, value in inner:
            path = f"{title}.{key}" if title else key
            for name, table in tables_of(value, path):
                if len(items) > 1:  # say which parent these rows belong to
                    table = [{**row, **child} for child in table]
                nested.setdefault(name, []).extend(table)
    tables = [(title, rows)] if any(rows) else []
    return tables + list(nested.items())


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def headline(outcomes: dict[str, Outcome]) -> list[str]:
    """The figures the project's targets are stated in, next to their limits."""
    lines = ["| figure | measured | limit (same run) |", "|---|---|---|"]
    server = outcomes.get("server")
    if server is not None and isinstance(server.figures, dict):
        data = server.figures
        echo = max(data.get("zmq_echo_per_s") or [0.0])
        lines.append(f"| STORE, shared memory | {_cell(data.get('store_vs_memcpy'))} x memcpy | memcpy |")
        lines.append(
            f"| RETRIEVE, shared memory | {_cell(data.get('retrieve_vs_memcpy'))} x memcpy | memcpy |"
        )
        lookups = data.get("lookup_per_s") or 0.0
        lines.append(
            f"| LOOKUP {data.get('lookup_keys')} keys, sequential | {lookups:,.0f}/s "
            f"({lookups / echo if echo else 0:.2f} x) | bare ZeroMQ round trip {echo:,.0f}/s |"
        )
        if data.get("lookup_vs_zmq_echo_alternating") is not None:
            lines.append(
                f"| LOOKUP {data.get('lookup_keys')} keys, in rounds alternating with the bare round trip | "
                f"{data['lookup_vs_zmq_echo_alternating']:.2f} x | the same rounds' bare round trip |"
            )
        long_keys = data.get("long_lookup_keys")
        for label, figure in (
            ("LOOKUP, the same key list", "lookup_us_per_extra_key"),
            ("LOOKUP, a different key list each time", "lookup_distinct_us_per_extra_key"),
            ("RELEASE of what such a LOOKUP locked", "release_us_per_extra_key"),
        ):
            if data.get(figure) is not None:
                lines.append(
                    f"| {label}, per extra key ({long_keys} vs {data.get('lookup_keys')} keys) | "
                    f"{data[figure]:.3f} us | target 0.3 us |"
                )
    workload = outcomes.get("workload")
    if workload is not None and isinstance(workload.figures, list):
        for scenario in workload.figures:
            label = scenario["scenario"] + (f" ({scenario['l2']})" if scenario.get("l2") else "")
            for op in ("store", "lookup", "retrieve"):
                p50, p99 = scenario["p50_ms"].get(op), scenario["p99_ms"].get(op)
                if p50 is None:
                    continue
                limit = f"memcpy {scenario['memcpy_ms']:.2f} ms" if op != "lookup" else "p99 within 2x p50"
                if op == "lookup" and scenario.get("echo_p50_ms"):
                    # what the machine gives a bare round trip in the same loop (its floor)
                    echo_p50, echo_p99 = scenario["echo_p50_ms"], scenario["echo_p99_ms"]
                    limit += (
                        f"; a bare round trip there: {echo_p50:.2f} / {echo_p99:.2f} ms"
                        f" ({echo_p99 / echo_p50:.1f}x)"
                    )
                lines.append(f"| workload {label} {op} p50 / p99 | {p50:.2f} / {p99:.2f} ms | {limit} |")
    reference = outcomes.get("reference_server")
    if reference is not None and isinstance(reference.figures, dict):
        data = reference.figures
        lines.append(
            f"| LMCache's bench server, lmcache-tiers faster on every figure | "
            f"{'yes' if data.get('faster_on_every_figure') else 'no'} | LMCache 0.5.6's server, same run |"
        )
        direct = " (O_DIRECT)" if "--direct" in reference.command else ""
        lines.append(
            f"| the same, lookup p99 with a file L2{direct} | "
            f"{_cell(data.get('tiers_lookup_p99_with_l2_ms'))} ms | target 3 ms |"
        )
    nixl = outcomes.get("nixl")
    if nixl is not None and isinstance(nixl.figures, list):
        for row in nixl.figures:
            if row.get("method") in ("nixl_store_dynamic", "nixl_store"):
                lines.append(
                    f"| {row['method']} {row['case']} load / store | {_cell(row.get('load_ratio'))} / "
                    f"{_cell(row.get('store_ratio'))} x | {row.get('baseline')} |"
                )
    return lines


def write_report(outcomes: list[Outcome], load: dict[str, list[float]], out: Path) -> tuple[Path, Path]:
    by_name = {outcome.name: outcome for outcome in outcomes}
    parts = [
        "# lmcache-tiers benchmark report",
        "",
        f"Load average (1, 5, 15 min) before: {load['before']}, after: {load['after']}; "
        f"{os.cpu_count()} CPUs.",
        "",
        "## Headline figures",
        "",
        *headline(by_name),
    ]
    for outcome in outcomes:
        parts += [
            "",
            f"## {outcome.name}",
            "",
            f"`{' '.join(Path(c).name if '/' in c else c for c in outcome.command)}`",
        ]
        if outcome.skipped:
            parts += ["", f"Skipped: {outcome.skipped}."]
        elif outcome.error:
            parts += ["", f"Failed: {outcome.error}"]
        else:
            parts += ["", f"{outcome.seconds:.0f} s"]
            for title, rows in tables_of(outcome.figures):
                parts += ["", f"### {outcome.name}: {title}"] if title else []
                parts += ["", markdown_table(rows)]
    markdown = out.with_suffix(".md")
    markdown.write_text("\n".join(parts) + "\n")
    document = {
        "load_average": load,
        "benchmarks": {
            outcome.name: {
                "command": outcome.command,
                "seconds": outcome.seconds,
                "figures": outcome.figures,
                "skipped": outcome.skipped,
                "error": outcome.error,
            }
            for outcome in outcomes
        },
    }
    data = out.with_suffix(".json")
    data.write_text(json.dumps(document, indent=2))
    return markdown, data


def main() -> None:
    parser = BenchParser(__doc__)
    names = [bench.name for bench in BENCHES]
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(names)}")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks not to run")
    parser.add_argument("--full", action="store_true", help="each benchmark's own default sizes")
    parser.add_argument("--reference-venv", type=Path, default=DEFAULT_REFERENCE)
    parser.add_argument("--out", type=Path, default=Path("bench-report"), help="report path without suffix")
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name] or names
    skipped = {name for name in args.skip.split(",") if name}
    unknown = sorted((set(chosen) | skipped) - set(names))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {', '.join(names)}")
    load = {"before": load_average()}
    outcomes = []
    for bench in BENCHES:
        if bench.name not in chosen or bench.name in skipped:
            continue
        print(f"running {bench.name} ...", flush=True)
        outcome = run_bench(bench, args.full, args.reference_venv)
        status = outcome.skipped or outcome.error or f"done in {outcome.seconds:.0f} s"
        print(f"  {bench.name}: {status}", flush=True)
        outcomes.append(outcome)
    load["after"] = load_average()
    markdown, data = write_report(outcomes, load, args.out)
    print(f"report: {markdown} and {data}")


if __name__ == "__main__":
    main()
