"""The wire core on both of its paths: compiled by mypyc and pure Python.

``scripts/compile-core.sh`` compiles the hot core modules in place when it
can; the pure modules are the fallback. The whole suite runs on whichever
path is installed here; this file runs the core's own tests, the behaviour
suite, the chunked-body reader's and a few sidecar socket tests on the *other* path, in a
subprocess, so neither path can rot unseen: with ``TOKENWIRE_PURE_PYTHON=1``
when this checkout is compiled, on a compiled build of a copy
(``compile-core.sh --out``) imported first when it is not.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tokenwire.middleware
import tokenwire.sidecar
from tokenwire.middleware import compiled_modules

import setup

ROOT = Path(__file__).resolve().parents[1]
# The sidecar's compiled driver modules (exchange/, downstream/http1, upstream/transport, the
# upstream client, the stream's set-up) too: a few of its tests, with sidecars started in this process.
OTHER_PATH_TESTS = ["tests/middleware", "tests/behaviour", "tests/sidecar/test_upstream_body.py",
                    "tests/sidecar/test_streaming.py", "tests/sidecar/test_upstream_pool_framing.py",
                    "tests/sidecar/test_departures_burst.py", "tests/sidecar/test_upstream_conn.py",
                    "tests/sidecar/test_upstream_body_framed_chunks.py",
                    "tests/sidecar/test_exchange_garbage.py",
                    # The stream's set-up compiled since: the pick, CORS, the timers, the registry.
                    "tests/sidecar/test_balance_core.py", "tests/sidecar/test_cors.py",
                    "tests/sidecar/test_ownership.py", "tests/sidecar/test_readiness.py"]
# Runs in the subprocess: a compiled copy (if any) first on the path and
# imported before pytest starts (pytest then puts the checkout first, but the
# packages are in sys.modules by then), the path checked, then the tests.
BOOT = """
import sys
tree, want = sys.argv[1], sys.argv[2]
if tree:
    sys.path.insert(0, tree)
import tokenwire.middleware as core
import tokenwire.sidecar as sidecar
import tokenwire.middleware.core.stream as stream
assert not tree or core.__file__.startswith(tree) and sidecar.__file__.startswith(tree), (core, sidecar)
got = "compiled" if core.compiled_modules() else "pure"
assert got == want and stream.__file__.endswith(".py") == (want == "pure"), (want, core.compiled_modules())
print("core path:", got, core.compiled_modules(), flush=True)
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""
SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _is_extension(path: str) -> bool:
    return path.endswith(SUFFIXES)


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``function``'s own scope (a nested function, lambda or class is not walked)."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(node))


def test_no_compiled_function_gives_an_except_name_a_second_type() -> None:
    """Compiled, a name keeps the type of its first binding: ``except A as error``
    then ``except B as error`` in one function raised TypeError in the second
    (a Redis outage, B, through ``enter_resume``), where mypy finds nothing; so
    may an except name that is also a parameter or assigned in the same scope."""
    clashes = []
    for module in setup.MODULES:
        tree = ast.parse((ROOT / f"{module}.py").read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            arguments = function.args
            bound = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                     *filter(None, [arguments.vararg, arguments.kwarg])]}
            types: dict[str, set[str]] = {}
            for node in _own_nodes(function):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    bound.add(node.id)
                elif isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    types.setdefault(node.name, set()).add(ast.unparse(node.type))
            clashes += [(module, function.name, name) for name, kinds in types.items()
                        if len(kinds) > 1 or name in bound]
    assert clashes == []


def _holds_a_float(node: ast.expr) -> bool:
    return any((isinstance(item, ast.Constant) and isinstance(item.value, float))
               or (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and item.func.id == "float")
               for item in ast.walk(node))


def test_no_compiled_module_keeps_a_final_tuple_of_floats_unboxed() -> None:
    """A module-level ``X: Final = (0.5, float("inf"))`` is compiled into an
    unboxed C tuple whose "was it set" check reads the wrong way round: every
    read from another module raised ``NameError: value for final name ... was
    not set`` (mypyc 1.x). Annotated ``Final[tuple[float, ...]]`` it is an object
    like any other, and right."""
    unboxed = []
    for module in setup.MODULES:
        tree = ast.parse((ROOT / f"{module}.py").read_text())
        for node in tree.body:
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and ast.unparse(node.annotation) in ("Final", "typing.Final")
                    and isinstance(node.value, ast.Tuple) and _holds_a_float(node.value)):
                unboxed.append((module, node.target.id))
    assert unboxed == []


def test_compiled_modules_keep_their_constants_final() -> None:
    """A module-level constant (an upper-case name) of a compiled module is
    ``Final``: compiled, a final name is a C static or a literal, any other a
    lookup in the module's dict on every read (``fields_valid`` made 27 a call).
    Type variables are not constants."""
    plain = []
    for module in setup.MODULES:
        tree = ast.parse((ROOT / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names = [name.id for target in node.targets for name in ast.walk(target)
                         if isinstance(name, ast.Name)]  # a tuple of names too
                value = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                if "Final" in ast.unparse(node.annotation):
                    continue
                names, value = [node.target.id], node.value
            else:
                continue
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("TypeVar"):
                continue
            plain += [(module, name) for name in names if name.lstrip("_").isupper()]
    assert plain == []


def test_compiled_modules_when_imported_then_names_exactly_the_modules_loaded_as_extensions() -> None:
    compiled = set(compiled_modules())
    for package in (tokenwire.middleware, tokenwire.sidecar):
        for source in Path(package.__file__ or "").parent.glob("*.py"):
            if source.stem in ("__init__", "__main__"):
                continue
            name = f"{package.__name__}.{source.stem}"
            module = importlib.import_module(name)
            assert _is_extension(module.__file__ or "") == (name in compiled), (name, module.__file__)


@pytest.mark.slow
def test_pure_switch_when_set_then_every_module_comes_from_its_source() -> None:
    probe = ("import sys, tokenwire.middleware as m, tokenwire.sidecar.upstream.body; "
             "print(m.compiled_modules(), sorted(n for n, mod in sys.modules.items() "
             "if n.startswith('tokenwire.') and (getattr(mod, '__file__', '') or '').endswith("
             f"{SUFFIXES!r})))")
    env = {**os.environ, "TOKENWIRE_PURE_PYTHON": "1"}
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "() []"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_core_tests_when_run_on_the_other_path_then_pass(tmp_path: Path) -> None:
    """The core's tests and the behaviour suite, on the path this checkout does not use."""
    env = dict(os.environ)
    if compiled_modules():
        want, tree = "pure", ""
        env["TOKENWIRE_PURE_PYTHON"] = "1"
    else:
        want, tree = "compiled", str(tmp_path / "tree")
        env.pop("TOKENWIRE_PURE_PYTHON", None)
        build = subprocess.run([str(ROOT / "scripts" / "compile-core.sh"), "--out", tree],
                               capture_output=True, text=True, timeout=900)
        if build.returncode == 3:
            pytest.skip("no C compiler, Python headers or mypyc here: the compiled path cannot be built")
        assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([sys.executable, "-c", BOOT, tree, want, "-q", "-p", "no:cacheprovider",
                          *OTHER_PATH_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    assert f"core path: {want}" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
