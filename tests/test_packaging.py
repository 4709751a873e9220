"""The built wheel: package-dir mapping, data files, and a base install without torch.

The `tokenwire.*` names are mapped from top-level folders (setuptools
package-dir), which is easy to get subtly wrong in a wheel while an editable
install keeps working. So this builds the real wheel, installs it into a fresh
virtualenv that has no torch, and imports every module of the base install.
"""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

import setup

# The wheel's build compiles the hot modules with mypyc: 80-90 s on a quiet 2-core
# box, over the suite's 120 s per test on a busy one (the build fixture's own
# limit is 600 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Built:
    wheel: Path
    output: str
    """What the build printed (the backend's output included)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The wheel as a user builds it (``python -m build --wheel``, isolated)."""
    out = tmp_path_factory.mktemp("dist")
    # Without PYTHONDONTWRITEBYTECODE (which the test run may set): distutils says
    # "byte-compiling is disabled" for it, a note about this machine, not the package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (path,) = out.glob("tokenwire-*.whl")
    return Built(path, run.stdout + run.stderr)


@pytest.fixture(scope="module")
def wheel(built: Built) -> Path:
    return built.wheel


def test_wheel_when_built_here_then_its_hot_modules_are_compiled(built: Built, clean_venv: Path) -> None:
    """setup.py compiles with mypyc where a C compiler is (as this machine has), and
    the installed wheel imports them: compiled_modules() is what the build compiled."""
    why = setup._why_pure()  # the build's own reason for a pure wheel (the repository root is on sys.path)
    if why is not None:
        pytest.skip(f"the build makes the pure wheel here: {why}")
    assert re.search(r"-cp311-cp311-linux_\w+\.whl$", built.wheel.name), built.wheel.name
    with zipfile.ZipFile(built.wheel) as archive:
        extensions = {n for n in archive.namelist() if n.endswith(".so")}
    assert any(n.startswith("tokenwire/middleware/_core__mypyc.") for n in extensions), extensions
    probe = "import tokenwire.middleware as m; print(len(m.compiled_modules()))"
    run = subprocess.run([str(clean_venv), "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == len(extensions) - 1 > 0, (run.stdout, sorted(extensions))


def test_wheel_when_built_then_setuptools_warns_nothing(built: Built) -> None:
    """No setuptools warning (a newcomer reads them as errors): the data folders are
    declared as packages, the metadata is complete."""
    warnings = [line for line in built.output.splitlines()
                if "Warning" in line or "would be ignored" in line or line.lower().startswith("warning: ")]
    assert warnings == [], "\n".join(warnings[:20])


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)
    return python


def _modules(wheel: Path, package: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    prefix = "tokenwire/" + package + "/"
    return sorted(
        n[:-3].replace("/", ".").removesuffix(".__init__")
        for n in names if n.startswith(prefix) and n.endswith(".py")
        and not n.endswith("/__main__.py")  # runs the CLI when imported
    )


def test_wheel_maps_every_source_file(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for folder in ("middleware", "sidecar", "engine"):
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder).as_posix()
            assert f"tokenwire/{folder}/{relative}" in names, f"{folder}/{relative} missing from wheel"
    assert "tokenwire/__init__.py" in names and "tokenwire/__main__.py" in names  # python -m tokenwire
    for typed in ("tokenwire", "tokenwire/middleware", "tokenwire/sidecar", "tokenwire/engine"):
        assert f"{typed}/py.typed" in names, f"{typed} is not marked typed (PEP 561)"
    assert not any(n.startswith(("middleware/", "sidecar/", "engine/")) for n in names)
    data = [p for p in (ROOT / "engine" / "data").glob("*") if p.is_file()]
    for path in data:
        assert f"tokenwire/engine/data/{path.name}" in names
    # The gRPC API ships as its .proto and the code generated from it (with stubs for mypy).
    for name in ("streaming.proto", "streaming_pb2.py", "streaming_pb2.pyi", "streaming_pb2_grpc.py"):
        assert f"tokenwire/v1/{name}" in names, f"tokenwire/v1/{name} missing from wheel"


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_wheel_metadata_license_classifiers_urls(wheel: Path) -> None:
    metadata = _metadata(wheel)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    with zipfile.ZipFile(wheel) as archive:
        (license_name,) = (n for n in archive.namelist() if n.endswith("/licenses/LICENSE"))
        license_text = archive.read(license_name).decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert license_text == (ROOT / "LICENSE").read_text()
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # the expression says it
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
    for label, target in urls.items():
        # No public address yet, so none is listed; one added later must be a real link.
        assert target.startswith("https://"), (label, target)


def test_extras_install_only_what_each_image_needs(wheel: Path) -> None:
    requires = _metadata(wheel).get_all("Requires-Dist") or []

    def name(requirement: str) -> str:
        # "h11<0.17,>=0.16" and "uvloop>=0.19; sys_platform ..." alike: the name before any version
        found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert found is not None, requirement
        return found.group(0)

    def extra(extra_name: str) -> set[str]:
        return {name(r) for r in requires if f'extra == "{extra_name}"' in r}

    base = {name(r) for r in requires if "extra ==" not in r}
    assert base == {"h11", "h2", "httpcore", "uvloop", "prometheus-client", "opentelemetry-api"}
    # Traces: the API is in the base (no-op until configured), the SDK and exporter are not.
    assert extra("otel") == {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}
    assert "torch" in extra("engine") and "matplotlib" not in extra("engine")  # the engine image
    assert extra("demo") == {"matplotlib"}
    assert "torch" not in extra("asgi") | extra("redis") | extra("demo")


def test_base_install_imports_every_module_without_torch(wheel: Path, clean_venv: Path) -> None:
    # The gRPC gateway needs the grpc extra (protobuf); the sidecar imports it only when present.
    grpc_extra = [m for m in _modules(wheel, "sidecar") if m.startswith("tokenwire.sidecar.grpc_gateway.")]
    assert "tokenwire.sidecar.grpc_gateway.driver" in grpc_extra
    modules = ["tokenwire", *_modules(wheel, "middleware"),
               *(m for m in _modules(wheel, "sidecar") if m not in grpc_extra)]
    assert "tokenwire.middleware.core.stream" in modules and "tokenwire.sidecar" in modules
    script = (
        "import importlib, importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok', len(sys.modules))\n"
    )
    result = subprocess.run([str(clean_venv), "-c", script], capture_output=True, text=True,
                            timeout=120, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def test_console_script_without_torch(clean_venv: Path) -> None:
    tokenwire = clean_venv.parent / "tokenwire"
    help_run = subprocess.run([str(tokenwire), "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0, help_run.stderr
    assert "sidecar" in help_run.stdout
    unknown = subprocess.run([str(tokenwire), "no-such-command"], capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2
    engine = subprocess.run([str(tokenwire), "engine"], capture_output=True, text=True, timeout=60)
    assert engine.returncode == 2
    assert "'.[engine]'" in engine.stdout + engine.stderr
    # The engine's flags come from its config alone, so its help needs no torch.
    engine_help = subprocess.run([str(tokenwire), "help", "engine"], capture_output=True, text=True,
                                 timeout=60)
    assert engine_help.returncode == 0, engine_help.stderr
    assert "--max-running" in engine_help.stdout
    version = subprocess.run([str(clean_venv), "-m", "tokenwire", "--version"], capture_output=True,
                             text=True, timeout=60, cwd="/")
    assert version.returncode == 0, version.stderr
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.stdout.strip() == f"tokenwire {expected}"


def test_demo_report_without_matplotlib(clean_venv: Path, tmp_path: Path) -> None:
    """matplotlib is the ``demo`` extra, not a dependency: without it the report has no plots."""
    script = ("import sys; from pathlib import Path\n"
              "from tokenwire.tools.demo_report import write_plots\n"
              "assert write_plots({}, Path(sys.argv[1])) == []\n")
    result = subprocess.run([str(clean_venv), "-c", script, str(tmp_path)], capture_output=True,
                            text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "matplotlib is not installed" in result.stderr
