"""The reference-client driver connects afresh whatever its earlier clients left behind.

LMCache's client watches its socket through a monitor bound to
``inproc://monitor.s-<the socket's descriptor>`` in the ZeroMQ context it is given.  A
closed client's socket gives its descriptor back before ZeroMQ's reaper thread has
closed that monitor: a new client whose socket gets the same number, in the same context,
then fails with "Address already in use" -- no TCP port involved.  On a loaded machine
the driver's next ``connect`` did so.  The script below leaves exactly that behind in the
process-wide context (the endpoints of the descriptors the next socket can get, still
bound) before the driver connects.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_lmcache_reference import REF_ENV, REF_VENV, reference_installed  # noqa: F401
from tiers_e2e import HERE

from lmcache_tiers.testing.ports import free_port

pytestmark = pytest.mark.usefixtures("reference_installed")

LEFT_BEHIND = r"""
import json, os, sys
import zmq
sys.path.insert(0, sys.argv[1])
from lmcache_ref_driver import Driver

shared = zmq.Context.instance()
# The lowest free descriptors, which the next sockets get; each one's monitor endpoint is
# bound in the shared context, as a monitor not yet closed by the reaper leaves it.
numbers = [os.open(os.devnull, os.O_RDONLY) for _ in range(16)]
monitors = []
for number in numbers:
    monitors.append(shared.socket(zmq.PAIR))
    monitors[-1].bind(f"inproc://monitor.s-{number}")
for number in numbers:
    os.close(number)
driver = Driver()
answers = [driver.run({"op": "connect", "url": url}) for url in sys.argv[2:]]
print(json.dumps(answers), flush=True)
"""


def test_connect_is_not_refused_by_a_monitor_endpoint_an_earlier_client_left_bound() -> None:
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    done = subprocess.run(
        [str(REF_VENV / "bin" / "python"), "-c", LEFT_BEHIND, str(HERE), *urls],
        capture_output=True,
        text=True,
        env={**os.environ, **REF_ENV},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [{"connected": url} for url in urls]
