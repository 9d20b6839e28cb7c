"""The start-up clean-up's survey of mappings: one pass for all leftover segments, and,
when no write lease can tell whether a file is open elsewhere, a decision from the file's
owner and mode about which unreadable maps matter."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmcache_tiers.l1.segment import MapsSurvey, survey_mappings
from lmcache_tiers.l1.stale import MappingJudge, remove_files_of_dead_processes

UNSEEN_PIDS = (4_194_000, 4_194_001, 4_194_002)  # above every Linux pid_max
PATTERN = re.compile(r"^leftover_(\d+)$")


def test_the_clean_up_surveys_the_maps_once_for_all_its_leftovers(tmp_path: Path) -> None:
    surveyed: list[list[str]] = []

    def survey_counting(paths: list[str]) -> MappingJudge:
        surveyed.append(sorted(paths))
        return survey_mappings(paths)

    for pid in UNSEEN_PIDS:
        (tmp_path / f"leftover_{pid}").write_bytes(b"\0" * 4096)
    removed = remove_files_of_dead_processes(str(tmp_path), PATTERN, "file", mapped_by=survey_counting)
    assert sorted(removed) == [f"leftover_{pid}" for pid in UNSEEN_PIDS]
    assert len(surveyed) <= 1  # none when every lease proves its file unused


def _stat(path: Path, mode: int) -> os.stat_result:
    path.write_bytes(b"")
    path.chmod(mode)
    return os.stat(path)


def test_without_a_lease_only_unreadable_maps_of_users_who_could_open_the_file_keep_it(
    tmp_path: Path,
) -> None:
    owner_only = _stat(tmp_path / "owner_only", 0o600)
    owner = owner_only.st_uid
    stranger = owner + 4242
    assert owner != 0 or stranger != 0

    strangers_only = MapsSurvey({}, {stranger: 3})
    assert strangers_only.why_kept(owner_only, None) == ""

    owners = MapsSurvey({}, {owner: 1})
    assert f"1 of uid {owner}" in owners.why_kept(owner_only, None)

    roots = MapsSurvey({}, {0: 2})  # a root process may map any user's 0600 file
    assert "2 of uid 0" in roots.why_kept(owner_only, None)

    shared = _stat(tmp_path / "shared", 0o644)  # anyone may open it: every unreadable map counts
    assert f"3 of uid {stranger}" in strangers_only.why_kept(shared, None)


def test_a_lease_decides_over_unreadable_maps_and_a_visible_mapper_is_named(tmp_path: Path) -> None:
    info = _stat(tmp_path / "segment", 0o600)
    doubtful = MapsSurvey({}, {0: 5, info.st_uid: 5})
    assert doubtful.why_kept(info, False) == ""
    assert "another process has it open or mapped" in doubtful.why_kept(info, True)
    mapped = MapsSurvey({(info.st_dev, info.st_ino): [1234, 5678]}, {})
    assert mapped.why_kept(info, False).startswith("process 1234 maps it")
