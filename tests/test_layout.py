"""The house rules of the layout: rooms of one idea, a core that needs nothing,
imports that run one way, and a benchmark index that names every bench."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"middleware": "tokenwire.middleware", "sidecar": "tokenwire.sidecar",
            "tokenwire/tools": "tokenwire.tools"}
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of the middleware, the sidecar and the tools, by import name."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _nodes(body: list[ast.stmt]) -> list[ast.AST]:
    """Every node under ``body`` but those of ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.AST] = []
    for statement in body:
        if isinstance(statement, ast.If) and ast.unparse(statement.test) in ("TYPE_CHECKING",
                                                                            "typing.TYPE_CHECKING"):
            found += _nodes(statement.orelse)
            continue
        found += list(ast.walk(statement))
    return found


def _run_time_imports(name: str, path: Path) -> set[str]:
    """The modules ``path`` may import at run time: every import statement,
    a function's (deferred) ones too, but not those under ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: set[str] = set()
    for node in _nodes(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            imported.add(target)
            imported.update(f"{target}.{alias.name}" for alias in node.names)
    return imported


def test_no_module_of_the_middleware_or_sidecar_is_over_the_limit() -> None:
    too_long = {str(path.relative_to(ROOT)): lines for path in _modules().values()
                if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert too_long == {}, f"split these (one idea a module, at most {MAX_MODULE_LINES} lines): {too_long}"


def test_the_sidecar_top_holds_a_dozen_modules_and_no_tools() -> None:
    top = sorted(path.name for path in (ROOT / "sidecar").glob("*.py"))
    assert len(top) <= 12, top
    assert not (ROOT / "sidecar" / "tools").exists()


def test_the_wire_core_imports_only_the_standard_library_and_itself() -> None:
    core = "tokenwire.middleware.core"
    outside: dict[str, set[str]] = {}
    for name, path in _modules().items():
        if name != core and not name.startswith(core + "."):
            continue
        for target in _run_time_imports(name, path):
            top = target.split(".")[0]
            if target.startswith(core) or top == "__future__" or top in sys.stdlib_module_names:
                continue
            outside.setdefault(name, set()).add(target)
    assert outside == {}


def test_no_import_cycle_at_run_time() -> None:
    modules = _modules()
    graph = {name: {t for t in _run_time_imports(name, path) if t in modules and t != name}
             for name, path in modules.items()}
    # A package's own __init__ importing its modules is how a package is made,
    # not a cycle with them; everything else must form no loop.
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    seen: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for target in sorted(graph[node]):
            if seen.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in seen:
                visit(target, [*path, target])
        seen[node] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    assert cycles == [], f"run-time import cycles: {cycles}"


def test_the_bench_index_fits_a_screen_and_names_every_script() -> None:
    index = (ROOT / "bench" / "README.md").read_text()
    assert len(index.splitlines()) <= 250
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) > 10
    assert [name for name in scripts if name not in index] == []


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "bench").glob("*.py")))
def test_every_bench_script_starts(script: str) -> None:
    """Each benchmark imports what it needs and answers ``--help``: a bench the
    layout step left importing ``targets`` from its old folder failed only
    when someone next ran it."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_no_two_test_files_outside_a_package_share_a_name() -> None:
    """pytest imports a test file of a folder without ``__init__.py`` by its
    bare name, so two such files of one name stop the whole run at collection
    ("import file mismatch"), and only when both folders are collected."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if (path.parent / "__init__.py").exists():
            continue
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, "rename one of each: " + "; ".join(clashes)
