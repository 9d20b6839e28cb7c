"""``lmcache-tiers replay --help`` shows the default of every option that takes a value,
including what leaving it out means (no limit, no L2, no plot...)."""

from __future__ import annotations

import re

import pytest

from lmcache_tiers.cli.main import main

#: the start of an option's row: its name, maybe a short name, then a value placeholder
_VALUE_OPTION = re.compile(r"^│ (--[\w-]+)(?:,--[\w-]+)*(?:\s+-\w)?\s+<")


def _option_rows(help_text: str) -> dict[str, str]:
    """Each option's row of the help (its wrapped lines joined), by option name, for the
    options that take a value."""
    rows: dict[str, str] = {}
    current: str | None = None
    for line in help_text.splitlines():
        if line.startswith("│ --"):
            match = _VALUE_OPTION.match(line)
            current = match.group(1) if match else None
            if current is not None:
                rows[current] = ""
        elif not line.startswith("│ ") or not line[2:].startswith(" "):
            current = None  # the end of the options box, or another box
        if current is not None:
            rows[current] += " " + line.strip("│ ")
    return {name: " ".join(row.split()) for name, row in rows.items()}


def _help_rows(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``replay --help``'s option rows, printed wide enough that no row is cut."""
    monkeypatch.setenv("COLUMNS", "250")
    main(["replay", "--help"])
    return _option_rows(capsys.readouterr().out)


def test_every_option_with_a_value_shows_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _help_rows(capsys, monkeypatch)
    assert {"--url", "--limit", "--capacity", "--l2-adapter", "--config"} <= rows.keys(), sorted(rows)
    missing = sorted(name for name, row in rows.items() if "[default:" not in row)
    assert not missing, f"no default shown for {', '.join(missing)}"


def test_the_defaults_say_what_leaving_an_option_out_means(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _help_rows(capsys, monkeypatch)
    assert "[default: tcp://127.0.0.1:5555]" in rows["--url"]
    assert "[default: every request]" in rows["--limit"]
    # serve falls back on an embedded L2 in the user's cache directory; an in-process replay never
    assert "never serve's embedded default L2" in rows["--l2-adapter"]


def test_the_timeout_says_what_it_bounds_in_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It applies to --in-process too, where there is no server to reply or to wait for.
    row = _help_rows(capsys, monkeypatch)["--timeout"]
    assert "in-process, for each L2 load and for the L2 stores still in flight at the end" in row
