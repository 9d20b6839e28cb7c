"""Two STATUS replies of one server process, or of a server restarted in between."""

from typing import Any

from lmcache_tiers.replay.server import _restart_between


def _status(pid: int, uptime_s: float) -> dict[str, Any]:
    return {"server": {"pid": pid, "uptime_s": uptime_s}, "requests": {"l1_hit_chunks": 0}}


def test_one_process_is_no_restart_however_long_the_replay() -> None:
    assert _restart_between(_status(7, 50.0), _status(7, 3650.0), 3600.0) is None
    # the server's clock a little slower than this one's: within the slack
    assert _restart_between(_status(7, 50.0), _status(7, 3645.0), 3600.0) is None
    # the after reply may come long after it was asked for (L2 stores settling)
    assert _restart_between(_status(7, 50.0), _status(7, 4000.0), 3600.0) is None


def test_another_pid_is_a_restart() -> None:
    reason = _restart_between(_status(7, 50.0), _status(8, 3650.0), 10.0)
    assert reason is not None and "pid 7, then 8" in reason


def test_the_same_pid_with_less_uptime_than_time_passed_is_a_restart() -> None:
    # a container's server is pid 1 in every life
    reason = _restart_between(_status(1, 50.0), _status(1, 70.0), 60.0)
    assert reason is not None and "restarted" in reason


def test_a_status_without_the_server_section_says_nothing() -> None:
    assert _restart_between({}, {}, 60.0) is None
    assert _restart_between({"server": {"pid": 1}}, {"server": {"pid": 1}}, 60.0) is None
