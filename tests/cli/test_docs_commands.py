"""Every ``lmcache-tiers`` command line README.md, CONTRIBUTING.md and docs/ give runs as
written, as far as its command and flags go, and every relative link resolves.

An operator copies these lines: a renamed flag or command left behind in a document is a
usage error on their first try, and a link to a moved heading is a dead end.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.cli.main import build_app, command_tree, main

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = "```"
#: an invocation in prose: `lmcache-tiers status --json`, `.venv/bin/lmcache-tiers serve`
INLINE_COMMAND = re.compile(r"`(?:[^`\s]*/)?lmcache-tiers((?: [^`]*)?)`")
#: an invocation in a code block: a line's command (after a prompt, environment variables or
#: a path) or one after ``&&``, ``;`` or ``|``
BLOCK_COMMAND = re.compile(
    r"(?:^\s*(?:\$\s+)?|(?:&&|;|\|)\s*)(?:[A-Z_]+=\S*\s+)*(?:\S*/)?lmcache-tiers(\s.*|)$"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6}\s+(.*)")


SHELL_OPERATORS = frozenset({"&", "&&", ";", "|", "||", ">", ">>", "2>", "<", "(", ")"})
#: a shell variable set in a code block: ``A='{"type": "s3", ...}'``
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S.*)$")


def _words(line: str) -> list[str] | None:
    """The shell words of ``line`` up to its first operator (``&``, ``|``, ``;``, a
    redirection) or comment; None while a quote is open."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = []
    try:
        for word in lexer:
            if word in SHELL_OPERATORS or word.startswith(("&", "|", ";", ">", "<")):
                break
            words.append(word)
    except ValueError:
        return None
    return words


def _joined(lines: list[str], index: int, first: str) -> tuple[str, int]:
    """``first`` (the rest of line ``index - 1``) joined with the lines after it across
    backslash continuations and quotes left open (a JSON value over several lines), and
    the index of the line after it."""
    command = first
    while (command.rstrip().endswith("\\") or _words(command) is None) and index < len(lines):
        if lines[index].lstrip().startswith(FENCE):
            break
        command = command.rstrip().removesuffix("\\") + " " + lines[index]
        index += 1
    return command, index


def invocations(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, words after ``lmcache-tiers``) of every invocation in ``text``: in
    code blocks (lines joined as a shell joins them, ``$NAME`` replaced by what the block
    set ``NAME`` to) and in inline code in prose."""
    lines = text.splitlines()
    in_block = False
    variables: dict[str, str] = {}
    index = 0
    while index < len(lines):
        line = lines[index]
        start = index
        index += 1
        if line.lstrip().startswith(FENCE):
            in_block = not in_block
            variables = {}
            continue
        if not in_block:
            for inline in INLINE_COMMAND.finditer(line):
                words = _words(inline.group(1))
                assert words is not None, f"line {start + 1}: unbalanced quotes in {inline.group(0)}"
                yield start + 1, words
            continue
        assigned = ASSIGNMENT.match(line)
        if assigned is not None:
            value, index = _joined(lines, index, assigned.group(2))
            variables[assigned.group(1)] = " ".join(_words(value) or [])
            continue
        found = BLOCK_COMMAND.search(line)
        if found is None or line.lstrip().startswith(("import ", "from ")):
            continue
        command, index = _joined(lines, index, found.group(1))
        words = _words(command)
        assert words is not None, f"line {start + 1}: unbalanced quotes in {command!r}"
        yield start + 1, [variables.get(word[1:], word) if word.startswith("$") else word for word in words]


def _options(command: Any) -> set[str]:
    return {option for param in command.params for option in (*param.opts, *param.secondary_opts)} | {
        "-h",
        "--help",
    }


def unknown_words(root: Any, words: list[str]) -> list[str]:
    """What of ``words`` (an invocation's, after the program name) the command line does not
    accept: a command that does not exist, or a flag its command does not have."""
    command = root
    rest = list(words)
    while rest and hasattr(command, "commands") and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        if sub is None:
            return [f"command {rest[0]!r}"]
        command = sub
        rest.pop(0)
    known = _options(command)
    return [
        f"{command.name} {word.split('=')[0]}"
        for word in rest
        if re.match(r"--?[a-z]", word) and word.split("=")[0] not in known
    ]


@pytest.fixture(scope="module")
def root() -> Any:
    command = command_tree(build_app())
    assert hasattr(command, "commands")
    return command


def test_documented_invocations_are_found() -> None:
    found = {path.name: len(list(invocations(path.read_text()))) for path in DOCUMENTS}
    assert found["README.md"] >= 8 and found["replay.md"] >= 5 and found["server.md"] >= 5, found


def test_every_documented_invocation_uses_commands_and_flags_that_exist(root: Any) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {problem}"
        for path in DOCUMENTS
        for number, words in invocations(path.read_text())
        for problem in unknown_words(root, words)
    ]
    assert wrong == [], "documented command lines the CLI would refuse"


def test_the_invocation_check_catches_a_stale_line(root: Any) -> None:
    text = "\n".join(
        [
            "Run `lmcache-tiers status --url tcp://h:1 --verbose` or `lmcache-tiers stats`.",
            FENCE + "bash",
            ".venv/bin/lmcache-tiers serve --l1-size-gb 4 \\",
            '    --l2-adapter \'{"type": "mock",',
            '                   "size": 1}\' --l2-size 3   # a comment --not-a-flag',
            "# the pool outlives lmcache-tiers restarts",
            " engine ── lmcache-tiers      engine ── lmcache-tiers",
            "bash install.sh && X_GB=5 lmcache-tiers plugins show --all",
            FENCE,
        ]
    )
    problems = [(n, p) for n, words in invocations(text) for p in unknown_words(root, words)]
    assert problems == [
        (1, "status --verbose"),
        (1, "command 'stats'"),
        (3, "serve --l2-size"),
        (8, "show --all"),
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    in_block = False
    for line in text.splitlines():
        if line.lstrip().startswith(FENCE):
            in_block = not in_block
            continue
        heading = HEADING.match(line)
        if in_block or heading is None:
            continue
        slug = base = _slug(heading.group(1))
        repeat = 0
        while slug in found:
            repeat += 1
            slug = f"{base}-{repeat}"
        found.add(slug)
    return found


def broken_links(path: Path) -> list[str]:
    prose = re.sub(FENCE + ".*?" + FENCE, "", path.read_text(), flags=re.S)
    broken = []
    for found in LINK.finditer(prose):
        target = found.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = [f"{path.relative_to(ROOT)}: {link}" for path in DOCUMENTS for link in broken_links(path)]
    assert broken == []


def test_the_link_check_catches_a_moved_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Open files: the limit\n\n## Open files: the limit\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n[ok](other.md#open-files-the-limit-1) [ok](#page) [gone](#top) [gone](missing.md)"
        " [gone](other.md#open-files) [web](https://example.com/x#y)\n"
    )
    assert broken_links(page) == [
        "#top (no such heading)",
        "missing.md (no such file)",
        "other.md#open-files (no such heading)",
    ]


#: a word that stands for something the reader fills in
PLACEHOLDER = re.compile(r"<[a-z][^>]*>|\.\.\.|\$")
TOML_BLOCK = re.compile(r"^```toml\n(.*?)^```", re.S | re.M)


def _decodes(args: list[str], capsys: pytest.CaptureFixture[str]) -> str | None:
    """None when ``serve --print-config ARGS`` resolves a configuration, else its error."""
    try:
        main(["serve", "--print-config", *args])
    except SystemExit as stop:
        if stop.code not in (0, None):
            return f"exit {stop.code}: {capsys.readouterr().err.strip()}"
    capsys.readouterr()
    return None


def test_every_documented_serve_command_line_is_a_valid_configuration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Adapter and front-end JSON, flag values: what ``serve`` would refuse before starting."""
    monkeypatch.setenv("COLUMNS", "300")
    monkeypatch.setenv("LMCACHE_TIERS_CACHE_DIR", str(tmp_path / "cache"))
    checked = 0
    refused = []
    for path in DOCUMENTS:
        for number, words in invocations(path.read_text()):
            if words[:1] != ["serve"] or {"-h", "--help"} & set(words):
                continue
            if any(PLACEHOLDER.search(word) for word in words):
                continue
            checked += 1
            error = _decodes([word for word in words[1:] if word != "--print-config"], capsys)
            if error is not None:
                refused.append(f"{path.relative_to(ROOT)}:{number}: {error}")
    assert refused == []
    assert checked >= 20


def test_every_documented_toml_configuration_is_valid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LMCACHE_TIERS_CACHE_DIR", str(tmp_path / "cache"))
    checked = 0
    refused = []
    for path in DOCUMENTS:
        text = path.read_text()
        for block in TOML_BLOCK.finditer(text):
            if "[project" in block.group(1) or PLACEHOLDER.search(block.group(1)):
                continue  # a package's metadata, not a server's configuration
            config = tmp_path / f"{checked}.toml"
            config.write_text(block.group(1))
            checked += 1
            error = _decodes(["--config", str(config)], capsys)
            if error is not None:
                refused.append(
                    f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, block.start()) + 1}: {error}"
                )
    assert refused == []
    assert checked >= 2


#: a path in the repository a document names, with a test after ``::`` if it names one
REPOSITORY_PATH = re.compile(
    r"(?<![\w/.-])((?:core|plugins|tests|bench|scripts|docs)/[\w./-]+?\.(?:py|sh|md|toml|txt|json))(?:::(\w+))?"
)


def missing_paths(text: str) -> list[str]:
    missing = []
    for found in REPOSITORY_PATH.finditer(text):
        path = ROOT / found.group(1)
        if not path.exists():
            missing.append(found.group(1))
        elif found.group(2) and f"def {found.group(2)}(" not in path.read_text():
            missing.append(f"{found.group(1)}::{found.group(2)}")
    return missing


def test_every_repository_path_a_document_names_exists() -> None:
    missing = [
        f"{path.relative_to(ROOT)}: {name}" for path in DOCUMENTS for name in missing_paths(path.read_text())
    ]
    assert missing == []


def test_the_path_check_catches_a_moved_file() -> None:
    text = "see `bench/bench_server.py`, tests/cli/test_docs_commands.py::test_nothing and core/gone.py"
    assert missing_paths(text) == ["tests/cli/test_docs_commands.py::test_nothing", "core/gone.py"]
