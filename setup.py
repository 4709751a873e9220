"""The compiled half of the build: the hot modules through mypyc, where it can.

Everything else about the package (its metadata, folders, data) is in
``pyproject.toml``; this file only adds the extensions. Building a wheel
(``python -m build``, ``pip install .``, ``pip wheel .``) compiles the modules
of :data:`MODULES` with mypyc when a C compiler, Python's headers and mypyc
(a build requirement) are present, and builds the pure wheel when any of them
is missing or ``TOKENWIRE_PURE_PYTHON=1`` is set, saying so in one line; the
same code runs either way (tests/test_compiled_core.py). ``scripts/compile-core.sh``
runs this file's ``build_ext --inplace`` for a checkout. An editable install
(``pip install -e .``) compiles nothing: the checkout's compile-core.sh does,
and keeps its extensions in step with the sources.

mypyc names a module after its file's path, and the sources live in
top-level folders (``middleware/``, ``sidecar/``) mapped onto ``tokenwire.*``,
so the modules are compiled from a copy laid out under their import names
(``build/mypyc/tree``, or ``$TOKENWIRE_MYPYC_DIR/tree``).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent

# The per-event path: a read goes through these on every event (sse, chunks,
# pending, meter, the sidecar's chunked-body reader), and the decisions each
# input takes live in the rest of the core. The sidecar's HTTP/1.1 driver is
# compiled too: its upstream socket callback (upstream/transport), the exchange
# that hands each read to the core (exchange/loop, exchange/slot) and the client
# connection's write (downstream/http1, its phases and the plain requests it
# reads without h11: http1_phases, http1_plain); and, once a stream, its upstream client
# (upstream/head, upstream/conn) and the heads it writes (downstream/h11_layout,
# exchange/forwarding). The ASGI driver, HTTP/2 and the rest stay Python;
# core/config.py reads TOML and signatures.
MODULES = (
    *(f"middleware/core/{name}" for name in (
        "accounting", "attempt", "chunks", "client_socket", "decisions", "errors", "events", "headers",
        "lifecycle", "meter", "pending", "record", "recording", "retry", "sse", "stream", "upstream_inputs",
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
    "sidecar/downstream/http1_plain",
    "sidecar/downstream/http1_phases",
    # Once a request: its head's checks, called from http1 (interpreted, they
    # cost the stream's set-up a few percent of its instructions), and the rules
    # both HTTP versions share.
    "sidecar/downstream/http1_faults",
    "sidecar/downstream/request_rules",
    # Once a stream, the rest of its set-up: the connection's transport and
    # peer, the request's framing checks, the upstream attempt and the pod's
    # pool, the protocol choice and the per-request settings. Interpreted, they
    # were 4 % of a short stream's instructions (bench/stream_cost.py,
    # docs/perf/stream-cost.md).
    "sidecar/downstream/connection",
    "sidecar/downstream/framing",
    "sidecar/upstream/attempt",
    "sidecar/upstream/pool",
    "sidecar/process/listener",
    "middleware/core/client_settings",
    # And the pod's pick, its grant and release, the stream's timers, spans,
    # route and CORS rules: some hundred interpreted calls a stream, about a
    # quarter of its instructions before (docs/perf/stream-cost.md).
    *(f"sidecar/balance/{name}" for name in ("balancer", "load", "members", "pods", "policies", "prefix",
                                              "verdicts")),
    "sidecar/upstream/pools",
    "sidecar/exchange/milestones",
    "sidecar/registry",
    "sidecar/tasks",
    "sidecar/downstream/cors",
    "middleware/shared/driver",
    "middleware/core/dialects/routes",
    "middleware/core/frames",
    # The end's metrics, folded once a stream as plain numbers (prometheus_client
    # calls were ~25 interpreted frames a stream).
    "middleware/process/figures",
)
GROUP = "tokenwire.middleware._core"
"""The library the compiled modules share (``middleware/_core__mypyc*.so``)."""
BUILDS = ("build", "build_ext", "bdist_wheel", "install")
"""The setuptools commands that make extensions; metadata, sdist and editable
installs (``egg_info``, ``dist_info``, ``sdist``, ``editable_wheel``) do not."""


def _say(line: str) -> None:
    print(f"tokenwire build: {line}", file=sys.stderr, flush=True)


def _why_pure() -> str | None:
    """Why this build cannot compile (``None`` when it can)."""
    if os.environ.get("TOKENWIRE_PURE_PYTHON") == "1":
        return "TOKENWIRE_PURE_PYTHON=1"
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h; Debian: python3-dev)"
    try:
        import mypyc.build  # noqa: F401  (a build requirement; absent where the build is not isolated)
    except ImportError:
        return "no mypyc (pip install mypy)"
    return None


def _source_tree(work: Path) -> Path:
    """A copy of the packages under their import names, for mypyc to compile from;
    the engine and the gRPC messages, only read for their types, linked."""
    tree = work / "tree"
    shutil.rmtree(tree / "tokenwire", ignore_errors=True)
    top = tree / "tokenwire"
    top.mkdir(parents=True)
    for source in (ROOT / "tokenwire").glob("*.py"):
        shutil.copy2(source, top / source.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    for package in ("middleware", "sidecar"):
        shutil.copytree(ROOT / package, top / package, ignore=ignore)
    for package, folder in (("engine", ROOT / "engine"), ("v1", ROOT / "tokenwire" / "v1")):
        (top / package).symlink_to(folder, target_is_directory=True)
    return tree


def _extensions() -> list[Any]:
    """mypyc's extensions for :data:`MODULES` (``[]`` for a pure build)."""
    if not any(command in sys.argv[1:] for command in BUILDS):
        return []
    why = _why_pure()
    if why is not None:
        _say(f"the pure-Python wheel ({why}); the same code, ~1.5x the CPU per event")
        return []
    from mypyc.build import mypycify

    work = Path(os.environ.get("TOKENWIRE_MYPYC_DIR") or ROOT / "build" / "mypyc").resolve()
    tree = _source_tree(work)
    _say(f"compiling {len(MODULES)} modules with mypyc (a minute or two)")
    here = Path.cwd()
    os.chdir(tree)  # mypyc names each module by its path from here
    try:
        # Types are checked by scripts/typecheck.sh (mypy --strict, every dependency
        # installed); a wheel's build has none of the dependencies, so it reads what it
        # follows silently and takes a dependency it cannot see as Any (its objects are
        # Python objects to the compiled code either way).
        # Its own config file: mypy would otherwise find the project's (strict) one
        # above the tree.
        config = work / "mypy.ini"
        config.write_text("[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n")
        paths = [f"tokenwire/{module}.py" for module in MODULES]
        return list(mypycify(["--config-file", str(config), *paths],
                             opt_level="2", target_dir=str(work / "c"), group_name=GROUP))
    except (Exception, SystemExit) as error:  # mypyc reports a type error by exiting
        if os.environ.get("TOKENWIRE_REQUIRE_COMPILED") == "1":
            raise
        _say(f"mypyc failed ({error}); the pure-Python wheel instead")
        return []
    finally:
        os.chdir(here)


class BuildExt(build_ext):
    """``build_ext`` that leaves the pure modules in place of extensions that
    fail to compile (a broken compiler, say) instead of failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # CompileError, LinkError, PlatformError: setuptools' own
            if os.environ.get("TOKENWIRE_REQUIRE_COMPILED") == "1":
                raise
            _say(f"the C build failed ({error}); the pure-Python wheel instead")
            # None of what did build: a module's extension without the library the
            # set shares would not import.
            for extension in self.extensions:
                Path(self.get_ext_fullpath(extension.name)).unlink(missing_ok=True)
            self.extensions = []


if __name__ == "__main__":  # setuptools runs it so; scripts/compile-core.sh imports it for _why_pure
    setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
