"""The README's install commands, read from README.md itself.

Shared by ``tests/test_install.py``, which runs the ``## Install`` section's
shell blocks in a fresh virtualenv, and ``tests/test_readme.py``, whose rule
for venv and pip lines checks that a block holding them is one of those.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## Install"
SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""PyTorch's CPU wheel index: the one place torch comes from without CUDA."""

# The same fence rule as tests/test_readme.py (so line numbers agree).
_FENCE = re.compile(r"^( *)```([\w+-]*)[^\n]*\n(.*?)^ *```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class ShellBlock:
    text: str
    line: int
    """1-based line of the opening fence in README.md."""

    def lines(self) -> list[str]:
        """Its command lines: continuations joined, blank and comment-only lines dropped."""
        joined = self.text.replace("\\\n", " ").splitlines()
        return [line.strip() for line in joined if line.strip() and not line.strip().startswith("#")]


def install_section(markdown: str) -> tuple[int, int]:
    """Where the ``## Install`` section lies in ``markdown``: (start, end) offsets."""
    match = re.search(rf"^{re.escape(HEADING)}[ \t]*$", markdown, re.M)
    if match is None:
        raise AssertionError(f"README.md has no {HEADING!r} section")
    following = re.search(r"^## ", markdown[match.end():], re.M)
    return match.start(), match.end() + following.start() if following else len(markdown)


def install_blocks(markdown: str | None = None) -> list[ShellBlock]:
    """The shell blocks of the Install section, in order."""
    markdown = README.read_text() if markdown is None else markdown
    start, end = install_section(markdown)
    return [ShellBlock(m.group(3), markdown.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(markdown, start, end) if m.group(2).lower() in SHELL_LANGUAGES]


def pip_install_commands(markdown: str) -> list[str]:
    """Every ``pip install ...`` the README shows, as written: the lines of its shell
    blocks and its inline code spans (a span's ``&&``/``;`` parts apart), whitespace
    collapsed."""
    found: list[str] = []
    for match in _FENCE.finditer(markdown):
        if match.group(2).lower() in SHELL_LANGUAGES:
            found += [line for line in ShellBlock(match.group(3), 0).lines() if "pip install" in line]
    prose = _FENCE.sub("", markdown)
    for span in re.findall(r"`([^`]*pip install[^`]*)`", prose):
        for part in re.split(r"&&|;", " ".join(span.split())):
            if "pip install" in part:
                found.append(part.strip())
    return found


def problems_of(command: str) -> list[str]:
    """What is wrong with one ``pip install`` command as a user would paste it:
    an unquoted ``[extra]`` (zsh takes it for a file pattern), ``tokenwire`` by name
    (it is on no index), torch from anywhere but PyTorch's CPU index (the default
    one serves the CUDA build)."""
    raw = shlex.split(command, comments=True, posix=False)
    words = shlex.split(command, comments=True)
    problems = [f"{token}: quote it, zsh reads [...] as a file pattern"
                for token in raw if "[" in token and token[0] not in "'\""]
    after = words[words.index("install") + 1:] if "install" in words else []
    requirements = [w for i, w in enumerate(after) if not w.startswith("-")
                    and not (i and after[i - 1] in ("--index-url", "-i", "--extra-index-url",
                                                    "--find-links", "-f", "-r", "-c"))]
    for requirement in requirements:
        name = re.split(r"[\[<>=!~ ;@]", requirement, maxsplit=1)[0]
        if name.lower() == "tokenwire":
            problems.append(f"{requirement}: tokenwire is on no index; install '.[extra]' from "
                            "the clone, or a built wheel")
        if name.lower() == "torch":
            indexes = [after[i + 1] for i, w in enumerate(after[:-1])
                       if w in ("--index-url", "-i", "--extra-index-url")]
            indexes += [w.split("=", 1)[1] for w in after
                        if w.startswith(("--index-url=", "--extra-index-url="))]
            if not any(url.rstrip("/") == CPU_INDEX for url in indexes):
                problems.append(f"{requirement}: without --index-url {CPU_INDEX} this is the "
                                "CUDA build, several GB")
    return problems


def extras_of(command: str) -> set[str]:
    """The extras a ``pip install`` line asks for (``'.[a,b]'`` -> {a, b})."""
    extras: set[str] = set()
    for word in shlex.split(command, comments=True):
        match = re.search(r"\[([\w,\s-]+)\]$", word)
        if match and not word.startswith("-"):
            extras |= {e.strip() for e in match.group(1).split(",") if e.strip()}
    return extras
