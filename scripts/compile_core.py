"""setuptools script run by ``scripts/compile-core.sh``: the hot sans-IO modules through mypyc.

Run with ``build_ext --inplace`` from a tree that lays the sources out under
their import names (``tokenwire/middleware/*.py``, ``tokenwire/sidecar/...``,
copied: mypyc names a module after its file's path, and a link would be
followed to the repository's folder). Each compiled module's extension lands
beside its ``.py`` there, with the library they share,
``tokenwire/middleware/_core__mypyc*.so``; the shell script copies them beside
the sources, where Python's importer prefers them.
Delete the ``.so`` files (``scripts/compile-core.sh --clean``) and the same
modules run as plain Python.

Usage: ``python compile_core.py CONFIG_TOML TARGET_DIR build_ext --inplace``.
"""

from __future__ import annotations

import sys

from mypyc.build import mypycify
from setuptools import setup

# The per-event path: a read goes through these on every event (sse, chunks,
# pending, meter, the sidecar's chunked-body reader), and the decisions each
# input takes live in the rest of the core. The sidecar's HTTP/1.1 driver is
# compiled too: its upstream socket callback (upstream/transport), the exchange
# that hands each read to the core (exchange/loop, exchange/slot) and the client connection's write
# (downstream/http1); and, once a stream, its upstream client (upstream/head,
# upstream/conn) and the heads it writes (downstream/h11_layout,
# exchange/forwarding). The ASGI driver, HTTP/2 and
# the rest stay Python; core/config.py reads TOML and signatures.
MODULES = (
    *(f"middleware/core/{name}" for name in (
        "accounting", "attempt", "chunks", "client_socket", "decisions", "errors", "events", "headers",
        "lifecycle", "meter", "pending", "recording", "retry", "sse", "stream", "upstream_inputs",
        # The dialects: the core asks them of every parsed event (compiled, a
        # native method call; interpreted, a Python call from compiled code).
        "dialects/base", "dialects/chat", "dialects/responses", "dialects/anthropic")),
    "sidecar/upstream/body",
    "sidecar/upstream/head",
    "sidecar/upstream/conn",
    "sidecar/downstream/h11_layout",
    "sidecar/exchange/forwarding",
    "sidecar/upstream/transport",
    "sidecar/exchange/loop",
    "sidecar/exchange/slot",
    "sidecar/downstream/http1",
    # Once a request: its head's checks, called from http1 (interpreted, they
    # cost the stream's set-up a few percent of its instructions).
    "sidecar/downstream/http1_faults",
)


def main() -> None:
    config_toml, target_dir = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]
    paths = [f"tokenwire/{module}.py" for module in MODULES]
    setup(
        name="tokenwire-core",
        packages=sorted({"tokenwire." + module.rpartition("/")[0].replace("/", ".") for module in MODULES}),
        ext_modules=mypycify(["--config-file", config_toml, *paths], opt_level="2",
                             target_dir=target_dir, group_name="tokenwire.middleware._core"),
    )


if __name__ == "__main__":
    main()
