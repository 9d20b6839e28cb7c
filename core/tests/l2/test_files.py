"""Core's file-store code: names and paths, the start-up sweep, guarded removal, the lock."""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_tiers.errors import KeyValidationError
from lmcache_tiers.keys import MAX_CACHE_SALT_LEN, MAX_MODEL_NAME_LEN, ObjectKey
from lmcache_tiers.l2.files import (
    DirectoryInUseError,
    DirectoryLock,
    EntryKind,
    FileLayout,
    LocalFiles,
    PathLock,
    check_relative_dir,
    classify_name,
    identity_of,
    record_name,
)
from lmcache_tiers.l2.files.dirlock import LOCK_DIR_ENV
from lmcache_tiers.l2.record import encode_header

_names = st.text(
    alphabet=st.characters(blacklist_characters="/\\@\x00", blacklist_categories=("Cs",)),
    max_size=MAX_MODEL_NAME_LEN,
)
HEADER = 4096


def valid_key(model: str, salt: str, rank: int, group: int, digest: bytes) -> ObjectKey | None:
    try:
        return ObjectKey(model, rank, digest, group, salt)
    except KeyValidationError:
        return None


@settings(max_examples=300, deadline=None)
@given(
    model=_names.filter(bool),
    salt=_names.map(lambda s: s[:MAX_CACHE_SALT_LEN]),
    digest=st.binary(min_size=1, max_size=64),
    sharded=st.booleans(),
)
def test_every_valid_key_has_a_recognised_path_inside_the_root(
    model: str, salt: str, digest: bytes, sharded: bool
) -> None:
    key = valid_key(model, salt, 7, 3, digest)
    if key is None:
        return
    layout = FileLayout("/srv/cache", shard_dirs=sharded, temp_dir="tmp")
    path = layout.path_for(key)
    directory, name = posixpath.split(path)
    # Never outside the root, never hidden, never too long, always recognised as ours.
    assert posixpath.normpath(path).startswith("/srv/cache/")
    assert directory == layout.directory_for(key) and layout.owns(directory, key)
    assert not name.startswith(".") and "/" not in name and len(name.encode()) <= 255
    kind, decoded = classify_name(name)
    assert kind in (EntryKind.RECORD, EntryKind.DIGEST)
    assert kind is EntryKind.DIGEST or decoded == key
    assert posixpath.normpath(layout.temp_path(key)).startswith("/srv/cache/tmp/")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_root_of_slash_owns_the_records_it_puts_there(sharded: bool) -> None:
    # A URL naming a filesystem's top (dir:// over a directory, memory://) has the root "/".
    key = ObjectKey("llama", 3, bytes.fromhex("abcd" + "01" * 30))
    layout = FileLayout("/", shard_dirs=sharded)
    directory = layout.directory_for(key)
    assert layout.owns(directory, key) and layout.owns(directory + "/", key)
    assert not layout.owns("/elsewhere", key)


def test_plain_names_keep_the_names_of_earlier_caches() -> None:
    key = ObjectKey("llama", 3, bytes.fromhex("abcd" + "01" * 30), 1, "t")
    assert record_name(key) == key.file_stem() + ".bin"
    assert FileLayout("/r", shard_dirs=True).path_for(key) == f"/r/ab/cd/{key.file_stem()}.bin"


@pytest.mark.parametrize(
    ("model", "salt"),
    [(".hidden", ""), ("...", "x"), ("tab\there", "new\nline"), ("ünïcode", "salt"), ("a" * 256, "b" * 128)],
)
def test_unusual_names_are_escaped_and_round_trip(tmp_path: Path, model: str, salt: str) -> None:
    key = ObjectKey(model, 0, b"\x01" * 32, 0, salt)
    files = LocalFiles(FileLayout(str(tmp_path), shard_dirs=False), name="t", count=lambda *_: None)
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, b"payload", align=HEADER) + b"payload")
    os.close(fd)
    files.publish(key, temp)
    assert [p.parent for p in tmp_path.iterdir()] == [tmp_path]
    assert list(files.iter_records(lambda _key: HEADER)) == [(key, 7)]
    assert files.delete(key) and list(tmp_path.iterdir()) == []


def test_relative_tmp_dir_must_stay_inside_the_root() -> None:
    assert check_relative_dir("tmp/./x") == "tmp/x"
    for bad in ("/abs", "..", "a/../../b", "ab", "", "x.bin"):
        with pytest.raises(ValueError):
            check_relative_dir(bad)


def _store(files: LocalFiles, key: ObjectKey, payload: bytes) -> None:
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, payload, align=HEADER) + payload)
    os.close(fd)
    files.publish(key, temp)


def _files(root: Path, counts: dict[str, int], *, sharded: bool = False) -> LocalFiles:
    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    return LocalFiles(FileLayout(str(root), shard_dirs=sharded), name="t", count=count)


def test_truncated_and_empty_records_are_removed_when_listed(tmp_path: Path) -> None:
    counts: dict[str, int] = {}
    files = _files(tmp_path, counts, sharded=True)
    keys = [ObjectKey("m", 0, bytes([i]) * 32) for i in range(3)]
    for key in keys:
        _store(files, key, b"x" * 100)
    os.truncate(files.layout.path_for(keys[0]), 0)
    os.truncate(files.layout.path_for(keys[1]), HEADER - 1)
    listed = dict(files.iter_records(lambda _key: HEADER))
    assert listed == {keys[2]: 100}
    assert counts["truncated_records_removed"] == 2
    assert not os.path.exists(files.layout.path_for(keys[0]))
    assert dict(files.iter_records(lambda _key: HEADER)) == {keys[2]: 100}
    assert counts["truncated_records_removed"] == 2, "counted the first time only"


def test_discard_spares_a_record_published_after_the_judgement(tmp_path: Path) -> None:
    files = _files(tmp_path, {})
    key = ObjectKey("m", 0, b"\x02" * 32)
    _store(files, key, b"old")
    judged = identity_of(os.stat(files.layout.path_for(key)))
    _store(files, key, b"new")
    assert not files.discard(key, judged, "corrupt_records_removed", "checksum")
    assert os.path.exists(files.layout.path_for(key))
    assert files.discard(
        key, identity_of(os.stat(files.layout.path_for(key))), "corrupt_records_removed", "x"
    )


@contextmanager
def _no_free_descriptors(below: int) -> Iterator[None]:
    """Every new file descriptor fails with EMFILE: a real failure of the directory fsync
    (which opens the directory) while the rename before it, needing none, goes through.
    ``below``: the lowest descriptor open (every lower one is in use), which may be
    closed meanwhile without its number becoming free."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (below, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_store_whose_directory_cannot_be_fsynced_fails_and_leaves_no_record(
    tmp_path: Path, sharded: bool
) -> None:
    files = LocalFiles(
        FileLayout(str(tmp_path), shard_dirs=sharded), name="t", count=lambda *_: None, fsync=True
    )
    key = ObjectKey("m", 0, b"\x04" * 32)
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, b"bytes", align=HEADER) + b"bytes")
    # fd was the lowest free descriptor: with the limit at it, publish's close of it
    # frees no number the directory's open may take
    with _no_free_descriptors(below=fd), pytest.raises(OSError) as failure:
        files.publish(key, temp, fd)
    assert failure.value.errno == errno.EMFILE
    assert not os.path.exists(files.layout.path_for(key)) and not os.path.exists(temp)
    assert list(files.iter_records(lambda _key: HEADER)) == []
    _store(files, key, b"again")  # the next store of the key is not hindered
    assert dict(files.iter_records(lambda _key: HEADER)) == {key: 5}


def test_with_fsync_a_file_published_without_its_descriptor_is_fsynced_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = LocalFiles(
        FileLayout(str(tmp_path), shard_dirs=False), name="t", count=lambda *_: None, fsync=True
    )
    key = ObjectKey("m", 0, b"\x08" * 32)
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, b"bytes", align=HEADER) + b"bytes")
    os.close(fd)
    inode = os.stat(temp).st_ino
    synced: list[tuple[int, bool]] = []  # (inode, published yet) of each file fsync
    real_fsync = os.fsync

    def recording(descriptor: int) -> None:
        stat = os.fstat(descriptor)
        if stat.st_ino == inode:
            synced.append((stat.st_ino, os.path.exists(files.layout.path_for(key))))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording)
    files.publish(key, temp)
    assert synced == [(inode, False)], "the record's bytes are synced before it is renamed into place"


def test_a_publish_told_to_stop_during_its_fsync_renames_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop`` is asked after the record's fsync, right before the rename: a store that
    returns from a stuck fsync once its adapter started closing publishes nothing (the
    directory may be another server's by then), and the caller removes the temp file."""
    files = LocalFiles(
        FileLayout(str(tmp_path), shard_dirs=False), name="t", count=lambda *_: None, fsync=True
    )
    key = ObjectKey("m", 0, b"\x09" * 32)
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, b"bytes", align=HEADER) + b"bytes")
    closing: list[bool] = []
    real_fsync = os.fsync

    def closing_meanwhile(descriptor: int) -> None:
        real_fsync(descriptor)
        closing.append(True)  # the adapter started closing while this fsync was stuck

    monkeypatch.setattr(os, "fsync", closing_meanwhile)
    assert files.publish(key, temp, fd, stop=lambda: bool(closing)) is False
    assert closing == [True]
    assert not os.path.exists(files.layout.path_for(key))
    assert os.path.exists(temp)  # the caller's to remove
    monkeypatch.setattr(os, "fsync", real_fsync)
    fd, temp = files.create_temp(key)
    os.write(fd, encode_header(key, b"again", align=HEADER) + b"again")
    assert files.publish(key, temp, fd, stop=lambda: False) is True
    assert os.path.exists(files.layout.path_for(key))


def test_a_temp_file_told_to_stop_does_not_create_a_vanished_root_again(tmp_path: Path) -> None:
    """``stop`` is asked before a vanished root is created again: a store that finds it
    gone once its adapter started closing (the directory released) fails with the error,
    and neither creates the root nor locks it again (``on_root_recreated``)."""
    relocked: list[int] = []
    root = tmp_path / "cache"
    files = LocalFiles(
        FileLayout(str(root), shard_dirs=False),
        name="t",
        count=lambda *_: None,
        on_root_recreated=lambda: relocked.append(1),
    )
    key = ObjectKey("m", 0, b"\x0a" * 32)
    fd, _temp = files.create_temp(key)  # the root is known now
    os.close(fd)
    subprocess.run(["rm", "-rf", str(root)], check=True)
    with pytest.raises(FileNotFoundError):
        files.create_temp(key, stop=lambda: True)
    assert not root.exists(), "a store past close created the released root again"
    assert relocked == []
    fd, temp = files.create_temp(key, stop=lambda: False)  # not closing: created again
    os.close(fd)
    assert os.path.exists(temp) and relocked == [1]


@pytest.fixture
def synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directories LocalFiles fsyncs, relative to tmp_path, in order."""
    calls: list[str] = []
    real = LocalFiles._fsync_directory

    def recording(files: LocalFiles, directory: str) -> None:
        calls.append(os.path.relpath(directory, tmp_path))
        real(files, directory)

    monkeypatch.setattr(LocalFiles, "_fsync_directory", recording)
    return calls


def _fsynced_files(root: Path) -> LocalFiles:
    return LocalFiles(FileLayout(str(root), shard_dirs=True), name="t", count=lambda *_: None, fsync=True)


def test_with_fsync_every_new_directory_is_synced_into_its_parent(tmp_path: Path, synced: list[str]) -> None:
    files = _fsynced_files(tmp_path / "a" / "root")
    assert synced == ["a", "."]  # the entries naming a/root/ and a/
    key = ObjectKey("m", 0, b"\x05" * 32)
    synced.clear()
    _store(files, key, b"bytes")
    shard = os.path.relpath(os.path.dirname(files.layout.path_for(key)), tmp_path)
    outer = os.path.dirname(shard)
    # each new shard directory into its parent, then the record's directory after the rename
    assert synced == [outer, "a/root", shard], synced
    synced.clear()
    _store(files, ObjectKey("m", 0, b"\x05" * 31 + b"\x06"), b"bytes")  # same shard: known
    assert synced == [shard]


def test_a_root_made_by_someone_else_is_synced_into_its_parent(tmp_path: Path, synced: list[str]) -> None:
    (tmp_path / "root").mkdir()  # as the directory lock makes it
    _fsynced_files(tmp_path / "root")
    assert synced == ["."]


def test_a_directory_whose_sync_failed_is_synced_again_before_it_is_used(
    tmp_path: Path, synced: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _fsynced_files(tmp_path / "root")
    key = ObjectKey("m", 0, b"\x07" * 32)
    shard = os.path.dirname(files.layout.path_for(key))
    recording = LocalFiles._fsync_directory

    def failing_at_the_root(self: LocalFiles, directory: str) -> None:
        if directory == str(tmp_path / "root"):
            raise OSError(errno.EIO, "injected")
        recording(self, directory)

    monkeypatch.setattr(LocalFiles, "_fsync_directory", failing_at_the_root)
    with pytest.raises(OSError):
        _store(files, key, b"bytes")  # the shard directories are made, the root's sync fails
    assert os.path.isdir(shard)
    monkeypatch.setattr(LocalFiles, "_fsync_directory", recording)
    synced.clear()
    _store(files, key, b"bytes")
    outer = os.path.relpath(os.path.dirname(shard), tmp_path)
    # both shard directories into their parents again, then the record's directory
    assert synced == [outer, "root", os.path.relpath(shard, tmp_path)]


def test_temp_files_are_swept_and_foreign_files_kept(tmp_path: Path) -> None:
    counts: dict[str, int] = {}
    (tmp_path / "ab" / "cd").mkdir(parents=True)
    for path in (
        tmp_path / ".tmp-9-1.part",
        tmp_path / "ab" / "cd" / ".tmp-9-2.part",
        tmp_path / "notes.txt",
    ):
        path.write_bytes(b"partial")
    files = _files(tmp_path, counts, sharded=True)
    assert files.remove_temp_files() == 2
    assert counts["orphan_temp_files_removed"] == 2
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["notes.txt"]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_vanished_root_is_created_again(tmp_path: Path, sharded: bool) -> None:
    counts: dict[str, int] = {}
    root = tmp_path / "cache"
    files = _files(root, counts, sharded=sharded)
    key = ObjectKey("m", 0, b"\x03" * 32)
    _store(files, key, b"one")
    subprocess.run(["rm", "-rf", str(root)], check=True)
    _store(files, key, b"two")
    assert dict(files.iter_records(lambda _key: HEADER)) == {key: 3}
    assert counts["root_recreated"] == 1


def test_lock_survives_the_directory_being_removed_and_recreated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    root = tmp_path / "cache"
    lock = DirectoryLock(str(root))
    try:
        code = (
            "import sys; from lmcache_tiers.l2.files import DirectoryLock\n"
            "try:\n    DirectoryLock(sys.argv[1])\nexcept Exception as exc:\n"
            "    print(type(exc).__name__, exc); sys.exit(3)\n"
        )
        env = {**os.environ, LOCK_DIR_ENV: str(tmp_path / "locks")}
        first = subprocess.run(
            [sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env
        )
        assert first.returncode == 3 and f"(pid {os.getpid()})" in first.stdout
        subprocess.run(["rm", "-rf", str(root)], check=True)
        again = subprocess.run(
            [sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env
        )
        assert again.returncode == 3, "deleting the directory must not hand its lock to a second server"
        assert "DirectoryInUseError" in again.stdout
    finally:
        lock.release()
    DirectoryLock(str(root)).release()


def test_two_adapters_of_one_process_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    lock = PathLock("default-l2", what="the default cache")
    with pytest.raises(DirectoryInUseError, match="another adapter of this server"):
        PathLock("default-l2", what="the default cache")
    lock.release()
    PathLock("default-l2", what="the default cache").release()


def test_keys_in_log_lines_have_control_characters_escaped() -> None:
    key = ObjectKey("model\n2024-01-01 INFO forged", 0, b"\x01" * 4, 0, "salt\x1b[31m\r")
    stem = key.file_stem()
    assert stem.isprintable() and "%0A" in stem and "%1B" in stem and "%0D" in stem


def test_a_vanished_root_is_created_again_once_when_stores_find_it_gone_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores on several threads find the vanished root at the same moment: it is created
    again once, counted once, and the directory lock re-taken once (two re-takes at once
    close one descriptor twice -- by then perhaps another store's file -- and the second
    finds the directory locked by the first)."""
    import threading

    counts: dict[str, int] = {}
    relocked: list[int] = []
    root = tmp_path / "cache"

    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    files = LocalFiles(
        FileLayout(str(root), shard_dirs=False),
        name="t",
        count=count,
        on_root_recreated=lambda: relocked.append(1),
    )
    keys = [ObjectKey("m", 0, bytes([i]) * 32) for i in range(2)]
    subprocess.run(["rm", "-rf", str(root)], check=True)
    together = threading.Barrier(2)
    isdir = os.path.isdir

    def both_look_first(path: str) -> bool:
        gone = not isdir(path)
        if path == str(root):
            try:
                together.wait(1.0)  # both threads have looked before either creates it
            except threading.BrokenBarrierError:
                pass
        return not gone

    monkeypatch.setattr(os.path, "isdir", both_look_first)
    errors: list[BaseException] = []

    def store(key: ObjectKey) -> None:
        try:
            _store(files, key, b"payload")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=store, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert dict(files.iter_records(lambda _key: HEADER)) == {key: 7 for key in keys}
    assert counts["root_recreated"] == 1
    assert relocked == [1]


def test_a_vanished_root_found_by_a_store_into_a_new_shard_is_counted_and_relocked(
    tmp_path: Path,
) -> None:
    """The first store into a shard directory not made yet creates its parents too: when
    the root vanished, that store re-creates it -- counted, and the directory lock taken
    on the new inode -- like one whose directory was known."""
    counts: dict[str, int] = {}
    relocked: list[int] = []
    root = tmp_path / "cache"

    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    files = LocalFiles(
        FileLayout(str(root), shard_dirs=True),
        name="t",
        count=count,
        on_root_recreated=lambda: relocked.append(1),
    )
    first, other = ObjectKey("m", 0, b"\x03" * 32), ObjectKey("m", 0, b"\x04" * 32)
    _store(files, first, b"one")
    subprocess.run(["rm", "-rf", str(root)], check=True)
    _store(files, other, b"two")
    assert dict(files.iter_records(lambda _key: HEADER)) == {other: 3}
    assert counts.get("root_recreated") == 1
    assert relocked == [1]


def test_a_write_failure_line_never_shows_a_url_password(caplog: pytest.LogCaptureFixture) -> None:
    # A remote filesystem's error may quote the file's whole URL (an http:// store).
    from lmcache_tiers.l2.files.records import WriteFailures

    counted: dict[str, int] = {}
    failures = WriteFailures(
        "0:fs",
        "http://reader:s3cret@host/kv",
        lambda name, n: counted.update({name: counted.get(name, 0) + n}),
    )
    with caplog.at_level(logging.WARNING):
        failures.failed(
            "http://reader:s3cret@host/kv/ab.bin",
            OSError(5, "PUT http://reader:s3cret@host/kv/ab.bin failed"),
        )
        failures.failed("http://reader:s3cret@host/kv/cd.bin", OSError(errno.ENOSPC, "full"))
    assert counted == {"store_io_errors": 1, "store_no_space": 1}
    text = caplog.text
    assert "cannot write" in text and "no space left" in text
    assert "s3cret" not in text


def test_removal_and_listing_lines_never_show_a_url_password(caplog: pytest.LogCaptureFixture) -> None:
    # An fsspec store's paths are whole URLs (an http:// store's carry its password): the
    # sweep removing every record, and a listing that cannot read a header, name them.
    from lmcache_tiers.l2.files.records import RemovalFailures, log_unreadable_header

    path = "http://reader:s3cret@host/kv/ab.bin"
    counted: dict[str, int] = {}
    failures = RemovalFailures("0:fs", lambda name, n: counted.update({name: counted.get(name, 0) + n}))
    with caplog.at_level(logging.WARNING):
        failures.failed(path, OSError(errno.EACCES, f"DELETE {path} refused"))
        with pytest.raises(OSError) as raised:
            failures.report(0)
        log_unreadable_header("0:fs", path, OSError(errno.EIO, f"GET {path} failed"))
    assert counted == {"records_not_removed": 1}
    assert "could not be removed" in caplog.text and "cannot read the header" in caplog.text
    assert "s3cret" not in caplog.text
    assert "s3cret" not in str(raised.value), "the error a close or start raises names it too"
