"""Running the repo's example scripts (examples/*.py) in subprocesses, for tests.

REPO is the checkout's root (the scripts' working dir), SCRIPT_ENV the environment that makes
them import kvgraph from this checkout, and `free_port` a free local port to serve on.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The scripts import kvgraph from this checkout whether or not it is installed.
SCRIPT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
