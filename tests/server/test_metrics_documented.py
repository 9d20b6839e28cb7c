"""docs/server.md names every family a running server exports at /metrics, and every
``lmcache_tiers_*`` name the documentation gives is one the server exports.

An operator reads the list in docs/server.md to know what to scrape and alert on: a family
missing from it is invisible to them, and a documented name the server does not export is
an alert that never fires.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers_e2e import ServerProcess, fetch, start_server

ROOT = Path(__file__).resolve().parents[2]
SERVER_DOC = ROOT / "docs" / "server.md"
PREFIX = "lmcache_tiers_"

#: a backticked metric name, with or without the prefix and labels: `requests_total{...}`
BACKTICKED_NAME = re.compile(r"`(?:lmcache_tiers_)?([a-z][a-z0-9_]*)(?:\{[^`]*\})?`")
FULL_NAME = re.compile(r"\blmcache_tiers_[a-z0-9_]*[a-z0-9]\b")


def exported_families(server: ServerProcess) -> set[str]:
    """Names of the families in a scrape (from their ``# TYPE`` lines), prefix removed."""
    assert server.http_url is not None
    status, _, body = fetch(f"{server.http_url}/metrics")
    assert status == 200, body
    names = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    assert names and all(name.startswith(PREFIX) for name in names), names
    return {name.removeprefix(PREFIX) for name in names}


def _documented_names(text: str) -> set[str]:
    names = set(BACKTICKED_NAME.findall(text))
    return names | {name.removesuffix("_total") for name in names}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """The families a fresh server with an L2 (the mock adapter) exports: the tests read
    them only, so one server serves them all."""
    server = start_server(tmp_path_factory.mktemp("server"), adapters=[{"type": "mock", "max_size_gb": 0.5}])
    try:
        yield exported_families(server)
    finally:
        assert server.stop() == 0, server.output()
        assert not server.shm_path.exists(), "the L1 segment outlived the server"


def test_every_exported_family_is_listed_in_server_md(families: set[str]) -> None:
    documented = _documented_names(SERVER_DOC.read_text())
    missing = sorted(
        family
        for family in families
        if family not in documented and family.removesuffix("_total") not in documented
    )
    assert missing == [], f"families /metrics exports that docs/server.md does not name: {missing}"


def test_every_documented_full_name_is_exported(families: set[str]) -> None:
    exported = families
    known = exported | {family.removesuffix("_total") for family in exported}
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in documents
        for name in set(FULL_NAME.findall(path.read_text()))
        if name.removeprefix(PREFIX) not in known
        # the tour's grep names a prefix of several families
        and not any(family.startswith(name.removeprefix(PREFIX)) for family in exported)
    )
    assert unknown == [], f"documented metric names /metrics does not export: {unknown}"


# -- failure reasons -----------------------------------------------------------------------
#
# ``failures_total{reason}`` is one family whose label values are the operator's only clue
# to what went wrong; a reason no document explains is a counter they cannot act on.  The
# reasons are collected from the source (a server only exports those that happened), so
# the check needs no fault to be provoked.

SOURCE_ROOTS = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src"))]
REASON_DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "plugins").glob("*/README.md")),
]
#: methods whose first argument is a failure reason: ``EngineStats.fail`` and
#: ``FrontendStats.failure`` (called on an object named ``stats``), and the server's own
#: ``_count_failure``
FAILURE_METHODS = {"fail", "failure"}
STATS_OBJECTS = {"stats", "_stats"}
FAILURE_CALLS = {"_count_failure"}
#: callbacks that count a failure, by file: the HTTP endpoint counts through ``count``
FAILURE_CALLBACKS = {"core/src/lmcache_tiers/server/http.py": {"count"}}
#: functions that return failure counts as a dict whose literal keys are the reasons
REASON_DICTS = {
    ("core/src/lmcache_tiers/l1/access.py", "failures"),
    ("core/src/lmcache_tiers/l1/writes.py", "counts"),
}


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _source_files() -> dict[str, ast.Module]:
    """Every source file's tree, by path: a dict of its own for each caller, the trees
    parsed once (no scan changes one)."""
    return dict(_parsed_source_files())


@functools.cache
def _parsed_source_files() -> dict[str, ast.Module]:
    return {
        _relative(path): ast.parse(path.read_text(), str(path))
        for root in SOURCE_ROOTS
        for path in sorted(root.rglob("*.py"))
    }


def _string_constants(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module-level ``NAME = "text"`` assignments of every file, by name."""
    constants: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in tree.body:
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
                continue
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants.setdefault(target.id, set()).add(node.value.value)
    return constants


def _counts_a_failure(call: ast.Call, callbacks: set[str]) -> bool:
    if isinstance(call.func, ast.Name):
        return call.func.id in callbacks
    if not isinstance(call.func, ast.Attribute):
        return False
    if call.func.attr in FAILURE_CALLS:
        return True
    receiver = call.func.value
    receiver_name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    return call.func.attr in FAILURE_METHODS and receiver_name in STATS_OBJECTS


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


def _constant_args(trees: dict[str, ast.Module], paths: list[str], callee: str, position: int) -> set[str]:
    """String constants passed as argument ``position`` to ``callee`` in ``paths``."""
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(trees[path]):
            if isinstance(node, ast.Call) and _called_name(node) == callee and len(node.args) > position:
                argument = node.args[position]
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    found.add(argument.value)
    return found


def _dynamic_reasons(trees: dict[str, ast.Module]) -> dict[tuple[str, str], set[str]]:
    """The reasons of each count whose reason is computed, by (file, reason expression).

    A new computed reason fails the test until it is added here: the check cannot see
    what values it takes."""
    from lmcache_tiers.l2.interface import L2Op
    from lmcache_tiers.wire.protocol import ErrorCode

    controllers = "core/src/lmcache_tiers/controllers"
    native = "plugins/frontend-native/src/lmcache_plugin_frontend_native/rpc.py"
    mp = "plugins/lmcache-mp/src/lmcache_plugin_lmcache_mp"
    mp_files = [path for path in trees if path.startswith(mp + "/")]
    error_codes = {code.name.lower() for code in ErrorCode if code is not ErrorCode.OK}
    # where reasons counted elsewhere are added up or stored: they add none of their own
    passing_through = [
        "core/src/lmcache_tiers/controllers/stats.py",
        "core/src/lmcache_tiers/frontend.py",
        "core/src/lmcache_tiers/server/app.py",
        "core/src/lmcache_tiers/storage_status.py",
        "core/src/lmcache_tiers/cli/commands_server.py",
    ]
    return {(path, "reason"): set() for path in passing_through} | {
        (f"{controllers}/base.py", "f'l2_{kind}_pop_error'"): {
            f"l2_{op.name.lower()}_pop_error" for op in L2Op
        },
        (f"{controllers}/base.py", "f'l2_{kind}_orphan_error'"): {
            f"l2_{op.name.lower()}_orphan_error" for op in L2Op
        },
        (f"{controllers}/prefetch.py", "reason"): _constant_args(
            trees, [f"{controllers}/prefetch.py"], "_abandon", 1
        ),
        ("core/src/lmcache_tiers/storage.py", "reason"): _constant_args(
            trees, ["core/src/lmcache_tiers/storage.py"], "_refuse_before_evicting", 0
        ),
        (f"{controllers}/prefetch_results.py", "reason"): _constant_args(
            trees, [f"{controllers}/prefetch_results.py"], "_count", 0
        ),
        (native, "code.name.lower()"): error_codes,
        (native, "p.ErrorCode.INTERNAL.name.lower()"): {"internal"},
        # a refusal's own reason, or the two the loop gives exceptions that are not one
        (f"{mp}/loop.py", "reason"): _constant_args(trees, mp_files, "RequestRefused", 0)
        | {"mp_bad_request", "mp_handler_error"},
        # refuse_too_large counts a RequestTooLarge, whose reason is fixed
        (f"{mp}/base.py", "exc.reason"): {"mp_request_too_large"},
        # the reason of the BurstLog that logs it
        (f"{mp}/lookups.py", "log.reason or 'unspecified'"): _constant_args(
            trees, [f"{mp}/lookups.py"], "BurstLog", 1
        ),
    }


#: (file, function) pairs allowed to count a reason held in a variable (``fail(reason)``):
#: the reasons their callers pass are what ``_dynamic_reasons`` gives for that file and
#: expression.  A count from a variable anywhere else fails the scan, since a new helper
#: forwarding a reason would otherwise be taken for a known one and its callers' reasons
#: never checked: add the helper here AND its callers' reasons to ``_dynamic_reasons``.
FORWARDING_FUNCTIONS = {
    ("core/src/lmcache_tiers/cli/commands_server.py", "status_tables"),
    ("core/src/lmcache_tiers/controllers/prefetch.py", "_abandon"),
    ("core/src/lmcache_tiers/controllers/prefetch_results.py", "_count"),
    ("core/src/lmcache_tiers/controllers/stats.py", "fail"),
    ("core/src/lmcache_tiers/frontend.py", "failure"),
    ("core/src/lmcache_tiers/server/app.py", "_count_failure"),
    ("core/src/lmcache_tiers/server/app.py", "storage_status"),
    ("core/src/lmcache_tiers/storage.py", "_refuse_before_evicting"),
    ("core/src/lmcache_tiers/storage_status.py", "failure_counts"),
    ("plugins/lmcache-mp/src/lmcache_plugin_lmcache_mp/loop.py", "_unanswered"),
}
#: ``fail`` calls that count no failure reason: the L2 task board's (a task id)
NOT_COUNTING_FAIL_RECEIVERS = {"board"}
NOT_COUNTING_FAIL_FILES = {"core/src/lmcache_tiers/l2/tasks.py"}


def _enclosing_functions(tree: ast.Module) -> dict[int, str]:
    """The innermost function each node of ``tree`` sits in, by node id."""
    enclosing: dict[int, str] = {}
    for function in ast.walk(tree):  # outer functions first: inner ones overwrite
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(function):
                enclosing[id(inner)] = function.name
    return enclosing


def _unrecognised_fail_call(path: str, node: ast.AST, callbacks: set[str]) -> bool:
    """A ``<x>.fail(...)`` or ``<x>.failure(...)`` the scan does not take for a count (a
    stats object under another name): it would be missed without a word."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr not in FAILURE_METHODS or _counts_a_failure(node, callbacks):
        return False
    receiver = node.func.value
    receiver_name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    return receiver_name not in NOT_COUNTING_FAIL_RECEIVERS and path not in NOT_COUNTING_FAIL_FILES


def _subscripted_failures(node: ast.AST) -> ast.expr | None:
    """The key of ``<...>failures[key] = / +=``, else None."""
    target = node.target if isinstance(node, ast.AugAssign) else None
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    if not isinstance(target, ast.Subscript):
        return None
    holder = target.value
    name = (
        holder.attr
        if isinstance(holder, ast.Attribute)
        else holder.id
        if isinstance(holder, ast.Name)
        else ""
    )
    return target.slice if name.endswith("failures") else None


def counted_failure_reasons(trees: dict[str, ast.Module] | None = None) -> set[str]:
    """Every reason the code can count in ``failures_total``; unresolvable ones fail, and
    so does a count the scan could miss (see ``FORWARDING_FUNCTIONS``)."""
    trees = _source_files() if trees is None else trees
    constants = _string_constants(trees)
    dynamic = _dynamic_reasons(trees)
    reasons: set[str] = set()
    unresolved: list[str] = []

    def resolve(path: str, node: ast.AST, expression: ast.expr, enclosing: dict[int, str]) -> None:
        if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
            reasons.add(expression.value)
        elif isinstance(expression, ast.Name) and expression.id in constants:
            reasons.update(constants[expression.id])
        elif isinstance(expression, ast.Name) and (path, enclosing.get(id(node))) not in FORWARDING_FUNCTIONS:
            where = enclosing.get(id(node), "module level")
            unresolved.append(f"{path}:{node.lineno}: {expression.id} forwarded in {where}")
        elif (path, ast.unparse(expression)) in dynamic:
            reasons.update(dynamic[(path, ast.unparse(expression))])
        else:
            unresolved.append(f"{path}:{node.lineno}: {ast.unparse(expression)}")

    for path, tree in trees.items():
        callbacks = FAILURE_CALLBACKS.get(path, set())
        enclosing = _enclosing_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _counts_a_failure(node, callbacks):
                resolve(path, node, node.args[0], enclosing)
            elif _unrecognised_fail_call(path, node, callbacks):
                unresolved.append(
                    f"{path}:{getattr(node, 'lineno', 0)}: {ast.unparse(node)} (a stats object?)"
                )
            key = _subscripted_failures(node)
            if key is not None:
                resolve(path, node, key, enclosing)
            if isinstance(node, ast.FunctionDef) and (path, node.name) in REASON_DICTS:
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Dict):
                        for dict_key in inner.keys:
                            if isinstance(dict_key, ast.Constant) and isinstance(dict_key.value, str):
                                reasons.add(dict_key.value)
    assert unresolved == [], (
        "failure reasons the check cannot resolve (add them to _dynamic_reasons, a new "
        f"forwarding helper to FORWARDING_FUNCTIONS): {unresolved}"
    )
    return reasons


def test_every_failure_reason_is_documented() -> None:
    reasons = counted_failure_reasons()
    # the scan itself works: reasons of each kind of count are found
    assert {"l2_load_failed", "l1_nvme_write_error", "http_route_failed", "malformed"} <= reasons
    text = "\n".join(path.read_text() for path in REASON_DOCUMENTS)
    undocumented = sorted(reason for reason in reasons if not re.search(rf"\b{re.escape(reason)}\b", text))
    assert undocumented == [], f"failure reasons the code counts that no document names: {undocumented}"


# -- per-adapter stats ---------------------------------------------------------------------
#
# Core counts, for every adapter, what its batches did and dropped (``AdapterState.count``,
# or ``BackendContext.count`` for a backend's own): the adapter's ``stats()``, exported as
# ``adapter_stat{adapter,stat}``.  A stat no document explains is a number an operator sees
# move with no way to tell what it means.  Collected from the source, as the reasons are.

ADAPTER_CORE = "core/src/lmcache_tiers/l2"
#: the objects core counts a per-adapter stat on: ``state.count(...)`` and the like
COUNTING_OBJECTS = {"state", "_state", "context", "_context"}
#: files whose own ``self.count(...)`` counts a per-adapter stat
SELF_COUNTING = {f"{ADAPTER_CORE}/state.py", f"{ADAPTER_CORE}/context.py"}


def _counts_an_adapter_stat(path: str, call: ast.Call) -> bool:
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "count" and call.args):
        return False
    receiver = call.func.value
    if isinstance(receiver, ast.Name) and receiver.id == "self":
        return path in SELF_COUNTING
    receiver_name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
    return receiver_name in COUNTING_OBJECTS


def _dynamic_adapter_stats(trees: dict[str, ast.Module]) -> dict[tuple[str, str], set[str]]:
    """The stats of each count whose name is computed, by (file, name expression).

    A new computed name fails the test until it is added here."""
    from lmcache_tiers.l2.circuit import _REFUSED
    from lmcache_tiers.l2.interface import L2Op
    from lmcache_tiers.l2.record import RecordVerdict

    ops = f"{ADAPTER_CORE}/ops.py"
    every_tree = _source_files()
    return {
        # the counter of a key reported gone, or skipped before the backend call
        (ops, "counter"): _constant_args(trees, [ops], "_report_gone", 2)
        | _constant_args(trees, [ops], "_skip", 1),
        (f"{ADAPTER_CORE}/adapter.py", "f'{op.kind.name.lower()}_tasks'"): {
            f"{op.name.lower()}_tasks" for op in L2Op
        },
        (f"{ADAPTER_CORE}/circuit.py", "_REFUSED[method]"): set(_REFUSED.values()),
        (f"{ADAPTER_CORE}/context.py", "verdict.counter"): {verdict.counter for verdict in RecordVerdict},
        # the counter each adapter names when it makes its ``DeleteMarks``
        (f"{ADAPTER_CORE}/marks.py", "self._counter"): _constant_args(
            every_tree, list(every_tree), "DeleteMarks", 1
        ),
    }


def _inside_count_helpers(tree: ast.Module) -> set[int]:
    """Ids of the calls inside a ``def count``: the helpers forwarding a name, not counting one."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "count"
        for inner in ast.walk(node)
    }


def counted_adapter_stats() -> set[str]:
    """Every stat name core counts per adapter; unresolvable ones fail."""
    trees = {path: tree for path, tree in _source_files().items() if path.startswith(ADAPTER_CORE + "/")}
    constants = _string_constants(trees)
    dynamic = _dynamic_adapter_stats(trees)
    stats: set[str] = set()
    unresolved: list[str] = []
    for path, tree in trees.items():
        helpers = _inside_count_helpers(tree)
        for node in ast.walk(tree):
            counts = isinstance(node, ast.Call) and _counts_an_adapter_stat(path, node)
            if not counts or id(node) in helpers:
                continue
            assert isinstance(node, ast.Call)
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                stats.add(name.value)
            elif isinstance(name, ast.Name) and name.id in constants:
                stats.update(constants[name.id])
            elif (path, ast.unparse(name)) in dynamic:
                stats.update(dynamic[(path, ast.unparse(name))])
            else:
                unresolved.append(f"{path}:{node.lineno}: {ast.unparse(name)}")
    assert unresolved == [], (
        f"adapter stats the check cannot resolve (add them to _dynamic_adapter_stats): {unresolved}"
    )
    return stats


def test_every_adapter_stat_core_counts_is_documented() -> None:
    stats = counted_adapter_stats()
    # the scan itself works: stats of each kind of count are found
    assert {"lookup_hits", "store_keys_failed", "tasks_failed_closed", "load_tasks"} <= stats
    assert {"objects_vanished", "circuit_skipped_store_keys", "corrupt_records_removed"} <= stats
    text = "\n".join(path.read_text() for path in REASON_DOCUMENTS)
    undocumented = sorted(stat for stat in stats if not re.search(rf"\b{re.escape(stat)}\b", text))
    assert undocumented == [], f"adapter stats core counts that no document names: {undocumented}"


def _with_source_added(path: str, source: str) -> dict[str, ast.Module]:
    trees = _source_files()
    original = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    trees[path] = ast.parse(original + "\n" + source)
    return trees


@pytest.mark.parametrize(
    ("path", "source"),
    [
        # a second helper forwarding a reason, in a file whose ``reason`` is resolved
        (
            "core/src/lmcache_tiers/controllers/prefetch.py",
            "def _drop(stats, reason):\n    stats.fail(reason)\n\n_drop(None, 'never_documented')\n",
        ),
        # the engine's stats under another name
        ("core/src/lmcache_tiers/controllers/new_counter.py", "engine_stats.fail('never_documented')\n"),
    ],
)
def test_the_reason_scan_refuses_a_count_it_could_miss(path: str, source: str) -> None:
    with pytest.raises(AssertionError, match="cannot resolve"):
        counted_failure_reasons(_with_source_added(path, source))
