"""A few rows of the client grid on the pure-Python core.

The grid (``test_clients.py``) runs on whichever core this checkout imports:
the compiled one where ``scripts/compile-core.sh`` built it. The pure-Python
modules are the fallback wherever it could not be built, so real clients
read through them too, here: a handful of representative rows, in a child
process started with ``TOKENWIRE_PURE_PYTHON=1`` (the import finder of
``tokenwire/pure_python.py`` then loads every module from its ``.py``), its
batches limited to those rows (``TOKENWIRE_GRID_ROWS``), each row checked
exactly as in the grid. Where this checkout is pure already, the grid itself
is that pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenwire.middleware import compiled_modules

from .test_clients import ROWS_ENV

ROOT = Path(__file__).resolve().parents[3]
GRID = "tests/compat/clients/test_clients.py::test_client_through_tokenwire_as_directly"
ROWS = (
    ("openai-sync", "plain"),  # the SDK as most people use it
    ("openai-async", "slow_reader"),  # coalescing: the core's hottest path
    ("openai-stream-helper", "tool_calls"),  # the SDK's own accumulation of tool calls
    ("httpx-sse", "resume"),  # event ids and the replay store
    ("openai-sync-h2", "heartbeat"),  # HTTP/2 to the sidecar, heartbeats during a silent prefill
    ("openai-node", "error_mid_stream"),  # an in-band error, read by another language's SDK
)
# No browser row: Chromium's start and page cost ~8 s here, and what a browser
# adds (how it reads a body) does not depend on which core wrote it.
DRIVERS = ("middleware", "sidecar")
# Runs in the child: the pure path checked before the tests import anything else.
BOOT = """
import sys
import tokenwire.middleware as core
import tokenwire.middleware.core.stream as stream
assert not core.compiled_modules() and stream.__file__.endswith(".py"), (core.compiled_modules(), stream)
print("core path: pure", flush=True)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_few_rows_of_the_grid_pass_on_the_pure_python_core() -> None:
    if not compiled_modules():
        pytest.skip("this checkout runs the pure-Python core: the grid itself covers it")
    env = {**os.environ, "TOKENWIRE_PURE_PYTHON": "1",
           ROWS_ENV: ",".join(f"{client}.{feature}" for client, feature in ROWS)}
    ids = [f"{GRID}[{client}-{feature}-{driver}]" for client, feature in ROWS for driver in DRIVERS]
    run = subprocess.run([sys.executable, "-c", BOOT, "-q", "-p", "no:cacheprovider", *ids],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "core path: pure" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert f"{len(ids)} passed" in run.stdout, run.stdout[-3000:]
