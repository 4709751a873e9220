"""docs/architecture.md stays true to the tree: the files and functions it
names exist, and every pointer into it from the code lands on a heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("middleware", "sidecar", "engine", "tokenwire", "tests", "bench", "scripts", "conf", "docs")
TOP_FILES = ("README.md", "Dockerfile", "pyproject.toml")
# The rules table's functions live in the stream's modules unless a cell names a module.
STREAM = ("middleware/core/stream.py", "middleware/core/upstream_inputs.py", "middleware/core/decisions.py")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _repository_texts() -> dict[Path, str]:
    texts: dict[Path, str] = {}
    files = [ROOT / name for name in TOP_FILES]
    for folder in SOURCES:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in files:
        try:
            texts[path] = path.read_text()
        except UnicodeDecodeError:
            continue  # images, results
    return texts


@pytest.mark.slow
def test_every_pointer_into_the_document_lands_on_a_heading() -> None:
    anchors = {_slug(line.lstrip("#")) for line in DOC.read_text().splitlines() if line.startswith("#")}
    pointers = 0
    for path, text in _repository_texts().items():
        for anchor in re.findall(r"architecture\.md#([\w-]+)", text):
            pointers += 1
            assert anchor in anchors, f"{path.relative_to(ROOT)}: no heading for #{anchor}"
    assert pointers >= 5


def test_nothing_points_at_design_notes_the_repository_lacks() -> None:
    missing = "DESIGN" + ".md"  # spelled apart so this file does not match itself
    offenders = [str(p.relative_to(ROOT)) for p, text in _repository_texts().items() if missing in text]
    assert offenders == [], f"point these at docs/architecture.md instead: {offenders}"


def test_files_named_in_the_document_exist() -> None:
    named = set(re.findall(r"`((?:middleware|sidecar|engine|tests|conf|bench|scripts|tokenwire)/[\w./-]*)`",
                           DOC.read_text()))
    assert len(named) > 10
    assert [n for n in named if not (ROOT / n).exists()] == []


def test_every_module_of_the_middleware_sidecar_and_tools_is_named_in_the_document() -> None:
    """A module a newcomer cannot find in "The modules" is a room without a door."""
    text = DOC.read_text()
    modules = [p for top in ("middleware", "sidecar", "tokenwire/tools") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts]
    assert len(modules) > 50
    missing = sorted(str(p.relative_to(ROOT)) for p in modules if f"`{p.relative_to(ROOT)}`" not in text)
    assert missing == [], f"docs/architecture.md, The modules: add {missing}"


def test_functions_in_the_rules_table_exist_where_it_says() -> None:
    """Each cell of the "where" column names functions of the stream's modules
    unless it names a module first; after a refactor this says which rows to update."""
    text = DOC.read_text()
    table = text[text.index("| rule | key(s) | where |"):]
    table = table[:table.index("\n\n")]
    stale: list[str] = []
    for row in table.splitlines()[2:]:
        where = row.split("|")[3]
        modules = STREAM
        for token in re.findall(r"`([^`]+)`", where):
            if token.endswith(".py"):
                modules = (token,)
                continue
            source = "\n".join((ROOT / module).read_text() for module in modules)
            name = token.split(".")[-1]
            if not re.search(rf"(def|class) {re.escape(name)}\b|^{re.escape(name)} =", source, re.M):
                stale.append(f"{token} (in {', '.join(modules)})")
    assert stale == [], f"docs/architecture.md, wire rules table: not found: {stale}"
