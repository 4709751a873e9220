"""``TOKENWIRE_PURE_PYTHON=1``: tokenwire's pure-Python modules, even where compiled ones exist.

``scripts/compile-core.sh`` puts a compiled extension beside some modules'
``.py`` files, and Python's importer prefers the extension. With this
variable set when ``tokenwire`` is first imported, :class:`SourcesFirst`
imports those modules from their ``.py`` instead: the same behaviour, the
pure-Python cost (to rule the compiled path out, or to compare the two).
The package's ``__init__`` installs it; nothing else here runs on import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

ENV_VAR = "TOKENWIRE_PURE_PYTHON"
# The packages that may hold compiled modules, with their subpackages.
PACKAGES = ("tokenwire.middleware", "tokenwire.sidecar")


class SourcesFirst:
    """A meta-path finder: a module of :data:`PACKAGES` from its ``.py`` file."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if not path or not any(package == top or package.startswith(top + ".") for top in PACKAGES):
            return None
        for folder in path:
            source = Path(folder) / f"{name}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None  # a subpackage, or not there: the usual finders decide


def wanted() -> bool:
    """Whether the environment asks for the pure-Python modules."""
    return os.environ.get(ENV_VAR) == "1"


def install() -> None:
    """Puts :class:`SourcesFirst` ahead of the usual finders (once)."""
    if SourcesFirst not in sys.meta_path:
        sys.meta_path.insert(0, SourcesFirst)


def active() -> bool:
    """Whether tokenwire's modules are being imported from their ``.py`` files."""
    return SourcesFirst in sys.meta_path
