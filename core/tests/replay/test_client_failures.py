"""How a failed replay client's error reaches the parent's one error line."""

from __future__ import annotations

from lmcache_tiers.client import ClientError
from lmcache_tiers.replay.server import _explained


def test_a_client_error_is_shown_by_its_message_as_with_one_client() -> None:
    message = "the server stopped answering: 3 requests in a row got no reply (last: timed out)"
    assert _explained(ClientError(message)) == message


def test_anything_else_keeps_its_type_a_bug_is_told_apart() -> None:
    assert _explained(ValueError("bad value")) == "ValueError: bad value"
    assert _explained(KeyboardInterrupt()) == "KeyboardInterrupt: "
    assert _explained(ClientError()) == "ClientError: "
