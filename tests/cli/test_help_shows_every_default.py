"""Every option that takes a value says in ``--help`` what applies when it is left out,
``[default: none]`` included: an option whose help says nothing leaves the operator to
guess whether leaving it out means off, a built-in value or something chosen at start."""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_tiers.cli.main import build_app, command_tree, main


def _commands() -> list[tuple[list[str], Any]]:
    """Every command (not group) and its argument prefix."""
    found: list[tuple[list[str], Any]] = []
    pending: list[tuple[list[str], Any]] = [([], command_tree(build_app()))]
    while pending:
        path, command = pending.pop()
        children = getattr(command, "commands", None)
        if children is None:
            found.append((path, command))
        for name, sub in (children or {}).items():
            pending.append(([*path, name], sub))
    return sorted(found, key=lambda item: item[0])


def _takes_a_value(param: Any) -> bool:
    """An option with a value to leave out: not an argument, not hidden, not required and
    not a switch that is simply off unless given (``--json``)."""
    if getattr(param, "param_type_name", "") != "option" or param.hidden or param.required:
        return False
    return not (param.is_flag and not param.secondary_opts)


def _option_row(row: str) -> str:
    """A row of an options panel without its frame (``│ --flag ...``)."""
    return row.lstrip("│ ")


def test_every_option_that_takes_a_value_shows_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    missing = []
    for path, command in _commands():
        main([*path, "-h"])
        text = capsys.readouterr().out
        rows = text.splitlines()
        for param in command.params:
            if not _takes_a_value(param):
                continue
            flag = param.opts[0]
            # The option's row and the lines its help wraps onto, up to the next option.
            heads = (f"{flag} ", f"{flag},")
            start = next(index for index, row in enumerate(rows) if _option_row(row).startswith(heads))
            end = next(
                (index for index in range(start + 1, len(rows)) if _option_row(rows[index]).startswith("-")),
                len(rows),
            )
            if "[default:" not in " ".join(rows[start:end]):
                missing.append(f"{' '.join(path)} {flag}")
    assert missing == [], "\n".join(missing)
