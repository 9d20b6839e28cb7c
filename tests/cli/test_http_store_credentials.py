"""The credentials of an fsspec HTTP store are secrets too: an ``Authorization`` header, a
session cookie or a basic-auth pair given in ``storage_options`` (fsspec's
``HTTPFileSystem`` sends ``headers`` with every request, aiohttp takes ``auth``) is never
printed by ``--print-config`` nor by the start banner, which redact the same way."""

from __future__ import annotations

import json

from thirdparty import run_cli

from lmcache_tiers.config import redact_secrets

SECRET = "UzNDUjNULWJlYXJlcg"


def test_http_store_credentials_are_not_printed() -> None:
    adapter = {
        "type": "fs",
        "path": "https://store.example/kv",
        "storage_options": {
            "headers": {
                "Authorization": f"Bearer {SECRET}",
                "Proxy-Authorization": f"Basic {SECRET}",
                "Cookie": f"session={SECRET}",
                "Accept": "application/octet-stream",
            },
            "client_kwargs": {"auth": ["user", SECRET], "trust_env": True},
        },
    }
    result = run_cli(["serve", "--print-config", "--no-shm", "--l2-adapter", json.dumps(adapter)])
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout
    options = json.loads(result.stdout)["l2_adapters"][0]["storage_options"]
    assert options == {
        "headers": {
            "Authorization": "***",
            "Proxy-Authorization": "***",
            "Cookie": "***",
            "Accept": "application/octet-stream",
        },
        "client_kwargs": {"auth": "***", "trust_env": True},
    }


def test_names_merely_holding_the_letters_are_shown() -> None:
    """Only a field that is the credential is hidden: an author, a path."""
    shown = {"author": "a", "oauth_scope": "read", "auth_file_dir": "/etc/x", "proxy_auth": "u:p"}
    assert redact_secrets(shown) == {
        "author": "a",
        "oauth_scope": "read",
        "auth_file_dir": "/etc/x",
        "proxy_auth": "***",
    }
