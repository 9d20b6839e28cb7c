"""What README.md and docs/ say is installed is installed.

Every adapter or serde type the documentation names -- in configuration examples
(``"type": "nixl_store"``, ``type = "mock"``) or in prose that names a storage product or
codec (Redis, DAX, zstd ...) -- must be registered by a plugin of this repository.  When a
plugin providing one of them lands, its registration makes the claim true and this test
passes without changes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_tiers.cli.main import main
from lmcache_tiers.config_docs import SHIPPED_PREFIX
from lmcache_tiers.plugins import load_plugins

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

TYPE_IN_EXAMPLE = re.compile(r'(?:"type"\s*:\s*"|\btype\s*=\s*")([A-Za-z0-9_.-]+)"')

#: words that claim a component -> the component names any one of which makes them true
PROSE_CLAIMS: dict[str, tuple[str, ...]] = {
    r"\bRedis\b|\bValkey\b": ("redis", "valkey", "resp"),
    r"\bDAX\b": ("dax",),
    r"\braw[ _-]block": ("raw_block",),
    # the Mooncake trace format (replay) is not a claim about the Mooncake Store adapter
    r"\bMooncake\b(?! (?:format|trace|block|synthetic))": ("mooncake_store",),
    r"\bfsspec\b": ("fs",),
    # NIXL's OBJ backend talks to S3-compatible stores; "S3" alone claims an s3 adapter
    r"\bS3\b(?!-compatible| server|-FIFO)": ("s3",),
    r"\bzstd\b|\bZstandard\b": ("zstd",),
    r"\blz4\b": ("lz4",),
    r"\bfp8\b|\bFP8\b": ("fp8",),
    r"AES-GCM|\baesgcm\b": ("aesgcm",),
}


@pytest.fixture(scope="module")
def shipped() -> set[str]:
    registry = load_plugins().registry
    return {c.name.lower() for c in registry.components() if c.plugin.startswith(SHIPPED_PREFIX)}


def _matches(pattern: str | re.Pattern[str], path: Path) -> list[tuple[int, re.Match[str]]]:
    """(line number, match) for ``pattern`` in ``path``, matching across line breaks as
    prose wraps (a line break counts as a space)."""
    text = path.read_text()
    flat = text.replace("\n", " ")
    return [(text.count("\n", 0, found.start()) + 1, found) for found in re.finditer(pattern, flat)]


def test_documents_are_found() -> None:
    names = {path.name for path in DOCUMENTS}
    assert {"README.md", "configuration.md", "server.md", "nixl.md", "lmcache-compat.md"} <= names


def test_every_type_in_an_example_is_registered(shipped: set[str]) -> None:
    unregistered = [
        f"{path.relative_to(ROOT)}:{number}: {found.group(1)}"
        for path in DOCUMENTS
        for number, found in _matches(TYPE_IN_EXAMPLE, path)
        if found.group(1).lower() not in shipped
    ]
    assert unregistered == [], "documented types that no plugin of this repository registers"


def _says_not_shipped(path: Path, found: re.Match[str]) -> bool:
    """Whether the paragraph (a table counts as one) of a match says outright that it is
    not shipped: comparing with a codec the project chose against is not a claim."""
    text = path.read_text()
    start = text.rfind("\n\n", 0, found.start())
    end = text.find("\n\n", found.end())
    return "not shipped" in text[max(0, start) : end if end >= 0 else len(text)]


def test_every_backend_or_codec_named_in_prose_is_registered(shipped: set[str]) -> None:
    unregistered = [
        f"{path.relative_to(ROOT)}:{number}: {found.group(0)!r} needs one of {', '.join(names)}"
        for path in DOCUMENTS
        for pattern, names in PROSE_CLAIMS.items()
        for number, found in _matches(pattern, path)
        if not shipped.intersection(names) and not _says_not_shipped(path, found)
    ]
    assert unregistered == [], "documentation names components that are not shipped"


def test_the_check_catches_a_claim(shipped: set[str]) -> None:
    line = 'L2 (NIXL, S3, Redis) ... --l2-adapter \'{"type": "zstd_fs"}\''
    assert TYPE_IN_EXAMPLE.findall(line) == ["zstd_fs"] and "zstd_fs" not in shipped
    claimed = [pattern for pattern in PROSE_CLAIMS if re.search(pattern, line)]
    assert len(claimed) == 2
    assert not re.search(next(iter(p for p in PROSE_CLAIMS if "S3" in p)), "an S3-compatible store")


def test_help_texts_name_only_installed_components(
    shipped: set[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    for args in ([], ["serve"], ["plugins"], ["bench"], ["status"]):
        main([*args, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for name in TYPE_IN_EXAMPLE.findall(text):
            assert name.lower() in shipped, (args, name)
        for pattern, names in PROSE_CLAIMS.items():
            assert not re.search(pattern, text) or shipped.intersection(names), (args, pattern)
