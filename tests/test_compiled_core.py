"""The wire core on both of its paths: compiled by mypyc and pure Python.

``scripts/compile-core.sh`` compiles the hot core modules in place when it
can; the pure modules are the fallback. The whole suite runs on whichever
path is installed here; this file runs the core's own tests and the behaviour
suite on the *other* path, in a subprocess that imports a copy of the core
first (pure ``.py`` files when the checkout is compiled, a compiled build
when it is not), so neither path can rot unseen.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenwire.middleware
import tokenwire.sidecar
from tokenwire.middleware import compiled_modules

ROOT = Path(__file__).resolve().parents[1]
CORE_TESTS = ["tests/middleware", "tests/behaviour", "tests/sidecar/test_upstream_body.py"]
# Runs in the subprocess: the copy of the core first on the path and imported
# before pytest starts (pytest then puts the checkout first, but the package
# is already in sys.modules), checked to be the path asked for, then the tests.
BOOT = """
import sys
tree, want = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
import tokenwire.middleware as core
import tokenwire.sidecar as sidecar
assert core.__file__.startswith(tree) and sidecar.__file__.startswith(tree), (core, sidecar)
got = "compiled" if core.compiled_modules() else "pure"
assert got == want, (got, want, core.compiled_modules())
print("core path:", got, core.compiled_modules(), flush=True)
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _is_extension(path: str) -> bool:
    return path.endswith(SUFFIXES)


def test_compiledModules_whenImported_thenNamesExactlyTheModulesLoadedAsExtensions() -> None:
    compiled = set(compiled_modules())
    for package in (tokenwire.middleware, tokenwire.sidecar):
        for source in Path(package.__file__ or "").parent.glob("*.py"):
            if source.stem in ("__init__", "__main__"):
                continue
            name = f"{package.__name__}.{source.stem}"
            module = importlib.import_module(name)
            assert _is_extension(module.__file__ or "") == (name in compiled), (name, module.__file__)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_coreTests_whenRunOnTheOtherPath_thenPass(tmp_path: Path) -> None:
    """The core's tests and the behaviour suite, on the path this checkout does not use."""
    tree = tmp_path / "tree"
    if compiled_modules():
        want = "pure"
        (tree / "tokenwire").mkdir(parents=True)
        shutil.copy(ROOT / "tokenwire" / "__init__.py", tree / "tokenwire")
        for package in ("middleware", "sidecar"):  # the sidecar holds a compiled module too
            shutil.copytree(ROOT / package, tree / "tokenwire" / package,
                            ignore=shutil.ignore_patterns("__pycache__", *(f"*{s}" for s in SUFFIXES)))
    else:
        want = "compiled"
        build = subprocess.run([str(ROOT / "scripts" / "compile-core.sh"), "--out", str(tree)],
                               capture_output=True, text=True, timeout=900)
        if build.returncode == 3:
            pytest.skip("no C compiler, Python headers or mypyc here: the compiled path cannot be built")
        assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([sys.executable, "-c", BOOT, str(tree), want, "-q", "-p", "no:cacheprovider",
                          *CORE_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=1100)
    assert f"core path: {want}" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
