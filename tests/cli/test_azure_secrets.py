"""Azure credentials are secrets too: an account key or a connection string (which holds
the account key or a shared access signature) given to the NIXL AZURE_BLOB backend or to
an fsspec ``abfs://`` store is never printed by ``--print-config`` nor quoted by an error
line."""

from __future__ import annotations

import json

import pytest
from thirdparty import run_cli

from lmcache_tiers.config import redact_secrets, redact_url_secrets

SECRET = "QWNjb3VudEtleVNlY3JldA=="
CONNECTION_STRING = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
    f"AccountKey={SECRET};BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
)


def print_config(adapter: dict[str, object]) -> str:
    result = run_cli(["serve", "--print-config", "--no-shm", "--l2-adapter", json.dumps(adapter)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_nixl_azure_connection_string_is_not_printed() -> None:
    shown = print_config(
        {
            "type": "nixl_store",
            "backend": "AZURE_BLOB",
            "pool_size": 4,
            "backend_params": {"connection_string": CONNECTION_STRING, "container_name": "kv"},
        }
    )
    assert SECRET not in shown
    params = json.loads(shown)["l2_adapters"][0]["backend_params"]
    assert params == {"connection_string": "***", "container_name": "kv"}


def test_fsspec_azure_credentials_are_not_printed() -> None:
    shown = print_config(
        {
            "type": "fs",
            "path": "abfs://kv/cache",
            "storage_options": {
                "account_name": "devstoreaccount1",
                "account_key": SECRET,
                "connection_string": CONNECTION_STRING,
            },
        }
    )
    assert SECRET not in shown
    options = json.loads(shown)["l2_adapters"][0]["storage_options"]
    assert options == {"account_name": "devstoreaccount1", "account_key": "***", "connection_string": "***"}


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        (
            f"cannot connect with {CONNECTION_STRING} (refused)",
            "cannot connect with DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            "AccountKey=***;BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1; (refused)",
        ),
        (
            f"bad value 'BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2022&sig={SECRET}'",
            "bad value 'BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=***'",
        ),
        # a name merely ending like one is no credential
        ("MyAccountKeyName=visible", "MyAccountKeyName=visible"),
    ],
)
def test_a_connection_string_quoted_in_an_error_line_hides_its_key(text: str, hidden: str) -> None:
    assert redact_url_secrets(text) == hidden


def test_private_keys_are_redacted_by_name() -> None:
    shown = redact_secrets({"storage_options": {"private_key": SECRET, "username": "u"}})
    assert shown == {"storage_options": {"private_key": "***", "username": "u"}}


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        (
            f"https://acct.blob.core.windows.net/kv?sv=2022-11-02&ss=b&sig={SECRET}",
            "https://acct.blob.core.windows.net/kv?sv=2022-11-02&ss=b&sig=***",
        ),
        (
            f"'https://acct.blob.core.windows.net/?sig={SECRET}&se=2030'",
            "'https://acct.blob.core.windows.net/?sig=***&se=2030'",
        ),
        # a parameter merely holding the letters is no signature
        ("https://h/kv?design=a&sigma=b", "https://h/kv?design=a&sigma=b"),
    ],
)
def test_the_signature_of_a_sas_url_is_hidden(text: str, hidden: str) -> None:
    assert redact_url_secrets(text) == hidden
    assert redact_secrets({"account_url": text}) == {"account_url": hidden}


def test_a_key_passphrase_is_redacted_by_name() -> None:
    """fsspec's ``sftp://`` store hands ``passphrase`` (the private key's) to paramiko."""
    shown = redact_secrets({"storage_options": {"passphrase": SECRET, "key_filename": "/k/id"}})
    assert shown == {"storage_options": {"passphrase": "***", "key_filename": "/k/id"}}
