"""A typo in ``LMCACHE_TIERS_DISABLE_PLUGINS`` is a configuration mistake: every command
refuses with one line naming the unknown name and the installed plugins, exit 2, rather
than leave the plugin the operator meant to disable enabled."""

from __future__ import annotations

import pytest
from thirdparty import run_cli


@pytest.mark.parametrize("args", [["plugins", "list"], ["serve", "--print-config"]])
def test_an_unknown_name_is_one_line_and_exit_2(args: list[str]) -> None:
    result = run_cli(args, LMCACHE_TIERS_DISABLE_PLUGINS="redsi")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: LMCACHE_TIERS_DISABLE_PLUGINS names 'redsi'"), lines[0]
    assert "did you mean 'redis'?" in lines[0] and "installed plugins: " in lines[0]
    assert result.stdout == ""
