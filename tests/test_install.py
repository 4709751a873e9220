"""The README's Install section works as written, in a fresh virtualenv.

The commands are read from README.md (``## Install``; tests/readme_install.py),
never copied here, so an edit that breaks them breaks this test. The slow test
runs them, in order, in one bash script from a copy of the clone in a temp dir
(the copy is what gets built: ``pip install .`` and ``python -m build`` write
``build/``, ``*.egg-info`` and ``dist/`` beside the sources, and none of that
may land in the repository). The only rewrite: the torch line's PyTorch CPU
index, which this machine cannot reach, becomes a folder holding the CPU wheel
that lies on this machine's disk (found where pip's own configuration looks:
``PIP_FIND_LINKS`` and ``pip config``'s find-links), and a constraint pins torch
to that CPU build, so no step can fall back to a CUDA build of several GB.
Everything else comes from the machine's package indexes, as it would for a
user. Then the installed package is checked: ``tokenwire --version``, each
installed extra's requirements and imports, and torch without CUDA.

The fast tests check every ``pip install`` the README shows (extras quoted, no
``tokenwire`` from an index, torch only from PyTorch's CPU index), that the
section names every extra of pyproject.toml, and, where zsh is installed, that
zsh reads the lines as bash does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from readme_install import (
    CPU_INDEX,
    README,
    ROOT,
    extras_of,
    install_blocks,
    install_section,
    pip_install_commands,
    problems_of,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
VERSION: str = PYPROJECT["project"]["version"]

# What each extra is for, imported for real in the new virtualenv (the extra's
# requirements are checked from pyproject.toml as well, for every extra installed).
EXTRA_IMPORTS = {
    "engine": "import torch, transformers, tokenizers, safetensors, starlette, uvicorn\n"
              "import tokenwire.engine.server\n"
              "assert torch.version.cuda is None, ('a CUDA build of torch', torch.__version__)\n",
    "redis": "import redis, hiredis\nfrom tokenwire.middleware import RedisReplayStore\n"
             "RedisReplayStore('redis://127.0.0.1:6379/0')\n",
    "grpc": "import grpc, google.protobuf, grpc_health.v1.health, grpc_reflection.v1alpha.reflection\n"
            "from tokenwire.v1 import streaming_pb2_grpc\nimport tokenwire.sidecar.grpc_gateway.driver\n",
    "otel": "import opentelemetry.sdk.trace\nimport opentelemetry.exporter.otlp.proto.http.trace_exporter\n",
    "asgi": "import starlette\n",
    "demo": "import matplotlib\n",
}
TORCH_LINE = re.compile(r"^(?:\S+/)?pip3? install\b.*\btorch\b")
CPU_INDEX_OPTION = re.compile(rf"(--index-url|--extra-index-url|-i)[ =]{re.escape(CPU_INDEX)}/?(?=\s|$)")


def _commands() -> list[str]:
    return [line for block in install_blocks() for line in block.lines()]


# ---------------------------------------------------------------- what the README says


def test_the_install_section_creates_a_venv_then_installs_from_the_clone() -> None:
    commands = _commands()
    assert len(install_blocks()) >= 2, "README.md: the Install section has no shell blocks"
    assert re.fullmatch(r"python3? -m venv \S+", commands[0]), commands[0]
    assert re.fullmatch(r"(\.|source) \S+/bin/activate", commands[1]), commands[1]
    installs = [c for c in commands if re.match(r"pip3? install\b", c)]
    assert any(re.search(r"""['"]\.\[[\w,-]+\]['"]""", c) for c in installs), \
        f"no pip install '.[extra]' from the clone: {installs}"


def test_every_pip_install_in_the_readme_works_without_an_index_entry_for_tokenwire() -> None:
    """Extras quoted (zsh), tokenwire from the clone or a wheel (it is on no index),
    torch from PyTorch's CPU index; in the Install section and everywhere else."""
    commands = pip_install_commands(README.read_text())
    assert len(commands) >= 5, commands
    problems = [f"{command!r}: {problem}" for command in commands for problem in problems_of(command)]
    assert problems == [], "\n".join(problems)


def test_torch_comes_from_pytorchs_cpu_index_before_the_engine_extra() -> None:
    commands = _commands()
    torch_lines = [i for i, c in enumerate(commands) if TORCH_LINE.match(c)]
    engine_lines = [i for i, c in enumerate(commands) if "engine" in extras_of(c)]
    assert engine_lines, "the Install section installs no engine extra"
    assert torch_lines and torch_lines[0] < engine_lines[0], \
        "the CPU torch line must come before the first install of the engine extra"
    assert all(CPU_INDEX_OPTION.search(commands[i]) for i in torch_lines), [commands[i] for i in torch_lines]
    start, end = install_section(README.read_text())
    prose = README.read_text()[start:end]
    assert "PyTorch's CPU" in prose and f"--index-url {CPU_INDEX}" in prose, \
        "the section names PyTorch's CPU index in words and by its option"


def test_the_install_section_names_every_extra_and_no_other() -> None:
    start, end = install_section(README.read_text())
    section = README.read_text()[start:end]
    table = re.findall(r"^\| `([\w-]+)` \|", section, re.M)
    assert sorted(table) == sorted(EXTRAS), f"README's extras {table} vs pyproject.toml's {sorted(EXTRAS)}"
    asked = set().union(*(extras_of(c) for c in _commands()))
    assert asked <= set(EXTRAS), f"the commands ask for extras pyproject.toml lacks: {asked - set(EXTRAS)}"


def _stubbed_script() -> str:
    """The install lines with pip, python and python3 as functions that print
    their arguments, one per line."""
    stubs = "".join(f"{name}() {{ printf '%s\\n' \"{name}\" \"$@\"; }}\n"
                    for name in ("pip", "python", "python3"))
    return stubs + "\n".join(_commands()) + "\n"


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_reads_the_install_lines_as_bash_does(tmp_path: Path) -> None:
    """Unquoted ``.[engine]`` is a glob to zsh ("no matches found"); bash passes it on.
    In a folder with what the lines expect (the venv's activate script, a built
    wheel), each shell runs the lines with pip and python stubbed: same arguments."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / f"tokenwire-{VERSION}-py3-none-any.whl").write_text("")
    seen = {}
    for shell in ("bash", "zsh"):
        done = subprocess.run([shell, "-e", "-c", _stubbed_script()], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", f"{shell}: {done.stderr}"
        seen[shell] = done.stdout
    assert seen["zsh"] == seen["bash"]
    assert re.search(r"^\.\[[\w,-]+\]$", seen["zsh"], re.M), seen["zsh"]  # an extra, passed on as written


# ---------------------------------------------------------------- the commands, run


def _find_links() -> list[Path]:
    """The local folders pip looks in for wheels: PIP_FIND_LINKS and pip config's find-links."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, timeout=60)
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values += value.strip("'\"").split()
    return [Path(v.removeprefix("file://")) for v in values if not re.match(r"https?://", v)]


def _local_cpu_torch(pin: str | None, python_tag: str) -> Path | None:
    """A CPU torch wheel on this machine's disk for ``python_tag`` (``cp311``)."""
    for folder in _find_links():
        for wheel in sorted(folder.glob("torch-*+cpu-*.whl")) if folder.is_dir() else []:
            _, version, _, tags = parse_wheel_filename(wheel.name)
            if (pin is None or version.public == pin) and any(t.interpreter == python_tag for t in tags):
                return wheel
    return None


def _clean_env() -> dict[str, str]:
    """This environment without the test run's virtualenv and the reader's settings."""
    own_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PIP_CONSTRAINT")
           and not k.startswith("TOKENWIRE_")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != own_bin)
    env["PIP_NO_INPUT"] = "1"
    return env


def _copy_of_the_clone(into: Path) -> Path:
    """The files a clone has (tracked, and new ones git does not ignore), as they are now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, timeout=60, check=True).stdout
    for name in listed.decode().split("\0"):
        source = ROOT / name
        if name and (source.is_file() or source.is_symlink()):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name, follow_symlinks=False)
    return into


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_readme_install_commands_run_in_a_fresh_venv(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no clone to copy")
    env = _clean_env()
    # The build compiles the hot modules with mypyc where a C compiler is: minutes for
    # each of the section's builds on two cores. tests/test_packaging.py builds and
    # checks the compiled wheel; here the pure one is enough (setup.py's own switch).
    env["TOKENWIRE_PURE_PYTHON"] = "1"
    commands = _commands()
    torch_pins = [re.search(r"\btorch==([\w.]+)", c) for c in commands if TORCH_LINE.match(c)]
    pin = next((m.group(1) for m in torch_pins if m), None)
    python3 = re.fullmatch(r"(python3?) -m venv \S+", commands[0]).group(1)  # type: ignore[union-attr]
    tag = subprocess.run([python3, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, env=env, timeout=60, check=True).stdout.strip()
    wheel = _local_cpu_torch(pin, tag)
    if any(TORCH_LINE.match(c) for c in commands) and wheel is None:
        pytest.skip(f"no CPU torch wheel ({pin or 'any'}, {tag}) where pip looks on this machine: "
                    "the test would download torch")
    clone = _copy_of_the_clone(tmp_path / "clone")
    script = ["set -ex"]
    standin = tmp_path / "pytorch-cpu-index"
    if wheel is not None:
        # PyTorch's CPU index, as the README names it, stood in for by the CPU wheel on
        # disk; the constraint keeps any step from taking a CUDA torch instead.
        standin.mkdir()
        (standin / wheel.name).symlink_to(wheel)
        _, version, _, _ = parse_wheel_filename(wheel.name)
        (tmp_path / "constraints.txt").write_text(f"torch=={version}\n")
        env["PIP_CONSTRAINT"] = str(tmp_path / "constraints.txt")
    for command in commands:
        if TORCH_LINE.match(command):
            command, count = CPU_INDEX_OPTION.subn(f"--find-links {standin}", command)
            assert count == 1, command
        script.append(command)
    (tmp_path / "install.sh").write_text("\n".join(script) + "\n")
    log = tmp_path / "install.log"
    with log.open("w") as out:
        done = subprocess.run(["bash", str(tmp_path / "install.sh")], cwd=clone, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=1100)
    assert done.returncode == 0, "the README's install commands failed:\n" + log.read_text()[-6000:]

    venv_dir = clone / re.fullmatch(r"python3? -m venv (\S+)", commands[0]).group(1)  # type: ignore[union-attr]
    python, tokenwire = venv_dir / "bin" / "python", venv_dir / "bin" / "tokenwire"
    shown = subprocess.run([str(tokenwire), "--version"], capture_output=True, text=True, env=env,
                           timeout=60, cwd=tmp_path)
    assert shown.returncode == 0 and VERSION in shown.stdout + shown.stderr, shown

    # Run from outside the clone: there, `import tokenwire` would find its sources.
    listed = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                             "{d.metadata['Name']: d.version for d in m.distributions()}))"],
                            capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path, check=True)
    installed = {canonicalize_name(k): v for k, v in json.loads(listed.stdout).items()}
    extras = set().union(*(extras_of(c) for c in commands))
    for extra in sorted(extras):
        for line in EXTRAS[extra]:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            have = installed.get(canonicalize_name(requirement.name))
            assert have is not None, f"[{extra}]: {requirement.name} is not installed"
            assert requirement.specifier.contains(have, prereleases=True), (extra, line, have)
        if extra in EXTRA_IMPORTS:
            probe = subprocess.run([str(python), "-c", EXTRA_IMPORTS[extra]], capture_output=True,
                                   text=True, env=env, timeout=300, cwd=tmp_path)
            assert probe.returncode == 0, f"[{extra}]:\n{probe.stderr[-3000:]}"
    if "torch" in installed:
        assert installed["torch"].endswith("+cpu"), installed["torch"]
        cuda = sorted(n for n in installed if n.startswith(("nvidia-", "triton")))
        assert cuda == [], f"CUDA packages came with torch: {cuda}"
    where = subprocess.run([str(python), "-c", "import tokenwire, sys; print(tokenwire.__file__)"],
                           capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path, check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv_dir), where.stdout


def test_the_error_hints_install_as_the_readme_does() -> None:
    """A hint printed for a missing extra is a command the reader can run, held
    to the README's own rules (quoted extras, no index entry for tokenwire,
    torch from PyTorch's CPU index)."""
    found = []
    for folder in ("middleware", "sidecar", "engine", "tokenwire"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                # The command ends where the hint's prose goes on (" in tokenwire's clone").
                for command in re.findall(r"pip install [^\"()\n,]*?(?= in | then|[\"(),]|$)", line):
                    found += [f"{path.relative_to(ROOT)}:{number}: {problem}"
                              for problem in problems_of(command.rstrip(". "))]
    assert found == [], "\n".join(found)
