"""botocore's S3 service model is parsed once per process, not once per session: every
adapter's sessions (its start-up check's and its own) share one loader per data path,
while credentials, profiles and the data path itself are still each session's own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import botocore.loaders
import pytest
from lmcache_plugin_s3 import S3Config, service_models
from lmcache_plugin_s3.client import open_filesystem
from s3_helpers import AWS_CREDENTIAL_VARIABLES, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.seaweedfs import SeaweedS3

#: the file of the S3 service model, as the loader names it (no extension)
S3_MODEL = "/s3/2006-03-01/service-2"


@pytest.fixture
def model_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every read of the S3 service model's file from now on, by any loader; the process's
    loaders start empty, as in a process that has not opened an adapter yet."""
    reads: list[str] = []
    load_file = botocore.loaders.JSONFileLoader.load_file

    def counted(self: botocore.loaders.JSONFileLoader, file_path: str) -> object:
        found = load_file(self, file_path)
        if found is not None and file_path.endswith(S3_MODEL):
            reads.append(file_path)
        return found

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counted)
    service_models.loader_for.cache_clear()
    yield reads
    service_models.loader_for.cache_clear()  # no loader of a test's data path kept


def test_two_adapters_read_the_s3_model_once(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], model_reads: list[str]
) -> None:
    """Before: each adapter read it twice (its start-up check's session and its own), each
    time on the event loop of that session -- four reads for two adapters."""
    for index in range(2):
        opened.append(open_adapter(s3_config(seaweed, fresh_prefix("models")), l1, index=index))
    assert len(model_reads) == 1


def sessions_loader(config: S3Config) -> botocore.loaders.Loader:
    async def loader() -> botocore.loaders.Loader:
        return open_filesystem(config).session.get_component("data_loader")

    return asyncio.run(loader())


def test_the_data_path_is_each_sessions_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_reads: list[str]
) -> None:
    """A profile's ``data_path`` (and ``AWS_DATA_PATH``) still picks the models a session
    reads: sessions share the loader of the same data path only."""
    models = tmp_path / "models"
    models.mkdir()
    config_file = tmp_path / "config"
    config_file.write_text(f"[default]\n[profile own-models]\ndata_path = {models}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config_file))
    monkeypatch.delenv("AWS_DATA_PATH", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)

    default = sessions_loader(S3Config(bucket="b"))
    assert sessions_loader(S3Config(bucket="other")) is default
    own = sessions_loader(S3Config(bucket="b", profile="own-models"))
    assert own is not default
    assert own.search_paths[0] == str(models)
    assert str(models) not in default.search_paths

    monkeypatch.setenv("AWS_DATA_PATH", str(models))
    assert sessions_loader(S3Config(bucket="b")) is own


def test_credentials_are_still_each_sessions_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_reads: list[str]
) -> None:
    for variable in AWS_CREDENTIAL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    credentials = tmp_path / "credentials"
    credentials.write_text(
        "[first]\naws_access_key_id = AKIAFIRST\naws_secret_access_key = first-secret\n"
        "[second]\naws_access_key_id = AKIASECOND\naws_secret_access_key = second-secret\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))

    async def resolved(profile: str) -> tuple[str, botocore.loaders.Loader]:
        session = open_filesystem(S3Config(bucket="b", profile=profile)).session
        found = await session.get_credentials()
        return found.access_key, session.get_component("data_loader")

    (first_key, first_loader), (second_key, second_loader) = (
        asyncio.run(resolved(profile)) for profile in ("first", "second")
    )
    assert (first_key, second_key) == ("AKIAFIRST", "AKIASECOND")
    assert first_loader is second_loader
