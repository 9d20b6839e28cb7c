"""Shared code of file-per-object L2 stores (``fs``, ``nixl_store_dynamic``, ...).

* :mod:`~lmcache_tiers.l2.files.layout` -- key <-> file name, flat or sharded paths,
  temporary names;
* :mod:`~lmcache_tiers.l2.files.local` -- a local directory: atomic publish, guarded
  removal, listing with sizes, start-up sweep, a root re-created when it vanished;
* :mod:`~lmcache_tiers.l2.files.records` -- header sizes from the key, write failures
  (ENOSPC, I/O errors) counted and logged once per burst;
* :mod:`~lmcache_tiers.l2.files.dirlock` -- one server per directory;
* :mod:`~lmcache_tiers.l2.files.case_probe` -- a root whose filesystem folds letter case,
  told at start-up.
"""

from lmcache_tiers.l2.files.case_probe import warn_if_root_folds_case
from lmcache_tiers.l2.files.dirlock import DirectoryInUseError, DirectoryLock, PathLock, ProcessClaim
from lmcache_tiers.l2.files.layout import (
    RECORD_SUFFIX,
    EntryKind,
    FileLayout,
    check_relative_dir,
    classify_name,
    is_temp_name,
    record_name,
)
from lmcache_tiers.l2.files.local import ABSENT_FILE_ERRORS, FileIdentity, KeyStripes, LocalFiles, identity_of
from lmcache_tiers.l2.files.records import (
    RECORD_ALIGN,
    DeleteFailures,
    HeaderSizes,
    RemovalFailures,
    WriteFailures,
    is_out_of_space,
    judge_digest_record,
    keeps_unlisted,
    log_unreadable_header,
    record_key,
)

__all__ = [
    "ABSENT_FILE_ERRORS",
    "RECORD_ALIGN",
    "RECORD_SUFFIX",
    "DeleteFailures",
    "DirectoryInUseError",
    "DirectoryLock",
    "EntryKind",
    "FileIdentity",
    "FileLayout",
    "HeaderSizes",
    "KeyStripes",
    "LocalFiles",
    "PathLock",
    "ProcessClaim",
    "RemovalFailures",
    "WriteFailures",
    "check_relative_dir",
    "classify_name",
    "identity_of",
    "is_out_of_space",
    "is_temp_name",
    "judge_digest_record",
    "keeps_unlisted",
    "log_unreadable_header",
    "record_key",
    "record_name",
    "warn_if_root_folds_case",
]
