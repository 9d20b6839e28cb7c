"""botocore's service models, read once per process instead of once per session.

Every botocore session builds its own loader of the JSON files botocore ships (the S3
service model, its endpoint rules, endpoints and partitions) and parses them again: tens
of milliseconds of CPU per session, on the event loop the session serves, and an adapter
makes two sessions per start (its start-up check's and its own).  The files do not change
while a process runs, so every session of these adapters gets the process's loader of
its data path (``AWS_DATA_PATH``, or a profile's ``data_path``), which the session
resolves when it first needs a loader, as botocore does.  Credentials, profiles, regions
and config files are untouched: each session still resolves its own.

Sharing one loader across threads and event loops (each adapter's start-up check runs
on a thread of its own, each adapter on its own loop):

* The loader caches each result in a dict (``botocore.loaders.instance_cache``) once the
  result is complete: a session reads a whole model or parses one itself; two sessions
  missing together both parse the file and one result is kept -- the same data.
* botocore writes into loaded data in three places, each idempotent (applied again, it
  changes nothing): the S3 model's ``sdk-extras`` merge (before the model is cached),
  the first request of an S3 operation moving the bucket out of its ``requestUri``
  (the old path kept as ``authPath``, read only by SigV2 signing), and the endpoint
  resolver filling in the ``endpoints`` entry it resolves.  Sessions of one loader see
  them applied once instead of once each.  Nothing iterates an operation's ``http``
  dict; an ``endpoints`` entry is iterated only to resolve a FIPS or dual-stack
  endpoint, and gains keys only the first time the process resolves it.  Threads sharing
  one botocore client, which botocore supports, race on the operation rewrite alike.
"""

from __future__ import annotations

import functools

import aiobotocore.session
import botocore.loaders


@functools.cache
def loader_for(data_path: str | None) -> botocore.loaders.Loader:
    """The process's loader for ``data_path`` (None: botocore's own data and ~/.aws/models)."""
    return botocore.loaders.create_loader(data_path)


def share_service_models(session: aiobotocore.session.AioSession) -> None:
    """Give ``session`` the process's loader of its data path, in place of a fresh one."""
    # Lazily, like botocore's own registration: the data path is read from the session's
    # configuration (its profile's section included) only when a loader is first needed.
    session.lazy_register_component(
        "data_loader", lambda: loader_for(session.get_config_variable("data_path"))
    )
