"""Which modules of tokenwire run compiled.

``scripts/compile-core.sh`` (run by ``scripts/setup-venv.sh`` where a C
compiler and Python's headers are present) compiles the hot modules of the
sans-IO core, and the sidecar's chunked-body reader, with mypyc and puts each
extension beside its ``.py``; Python's importer prefers the extension. Without
them the same modules run as plain Python, and so they do, extensions or not,
when ``TOKENWIRE_PURE_PYTHON=1`` is set as tokenwire is first imported
(``tokenwire/pure_python.py``): the behaviour is the same on both paths, only
the CPU per event differs.
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from tokenwire.pure_python import PACKAGES, active

# The library the compiled modules share: not a module of tokenwire.
_SHARED_LIBRARY = "_core__mypyc"


def _folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # finds it without running its __init__
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


def compiled_modules() -> tuple[str, ...]:
    """The modules (full names) this interpreter imports as compiled
    extensions; ``()`` when tokenwire runs as pure Python."""
    if active():
        return ()
    found: set[str] = set()
    for package in PACKAGES:
        folder = _folder(package)
        if folder is None:
            continue
        for suffix in EXTENSION_SUFFIXES:
            for built in folder.rglob(f"*{suffix}"):
                name = built.name[: -len(suffix)]
                if name != _SHARED_LIBRARY and built.with_name(f"{name}.py").exists():
                    parts = built.parent.relative_to(folder).parts
                    found.add(".".join((package, *parts, name)))
    return tuple(sorted(found))
