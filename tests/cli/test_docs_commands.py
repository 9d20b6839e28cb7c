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

from lmcache_tiers.cli.main import build_app, command_tree

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


def _words(line: str) -> list[str] | None:
    """The shell words of ``line`` without a trailing comment; None while a quote is open."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return None


def invocations(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, words after ``lmcache-tiers``) of every invocation in ``text``: code
    blocks' lines joined across backslash continuations and quotes left open (a JSON value
    over several lines), and inline code in prose."""
    lines = text.splitlines()
    in_block = False
    index = 0
    while index < len(lines):
        line = lines[index]
        start = index
        index += 1
        if line.lstrip().startswith(FENCE):
            in_block = not in_block
            continue
        if not in_block:
            for inline in INLINE_COMMAND.finditer(line):
                words = _words(inline.group(1))
                assert words is not None, f"line {start + 1}: unbalanced quotes in {inline.group(0)}"
                yield start + 1, words
            continue
        found = BLOCK_COMMAND.search(line)
        if found is None or line.lstrip().startswith(("import ", "from ")):
            continue
        command = found.group(1)
        while (command.rstrip().endswith("\\") or _words(command) is None) and index < len(lines):
            if lines[index].lstrip().startswith(FENCE):
                break
            command = command.rstrip().removesuffix("\\") + " " + lines[index]
            index += 1
        words = _words(command)
        assert words is not None, f"line {start + 1}: unbalanced quotes in {command!r}"
        yield start + 1, words


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
