"""The sidecar image, built from the Dockerfile and checked inside (scripts/build-images.sh).

The script does the checking (the unprivileged user, ``tokenwire --version``,
compiled modules, the Redis client of each resume store form, the image's own
ENTRYPOINT + CMD proxying a stream from a fake upstream and answering
``/readyz``); this test runs it as a user would and reads what it says. With
podman the base is made here from Debian's packages (``--base debian``): a
registry's python image may not be reachable. The engine image (torch, the tiny model built in) is the same
script without ``--sidecar-only``, outside the default suite: it takes minutes
more and a torch wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _builder() -> str | None:
    """``podman`` or ``docker`` where it works here, else ``None``."""
    for tool in ("podman", "docker"):
        if shutil.which(tool) is None:
            continue
        if subprocess.run([tool, "info"], capture_output=True, timeout=60).returncode == 0:
            return tool
    return None


@pytest.mark.timeout(1800)
def test_sidecar_image_when_built_then_its_checks_pass_inside() -> None:
    tool = _builder()
    if tool is None:
        pytest.skip("neither podman nor a running Docker engine here (scripts/system-deps.sh podman buildah)")
    base = ["--base", "debian"] if tool == "podman" else []
    run = subprocess.run([str(ROOT / "scripts" / "build-images.sh"), "--sidecar-only", *base],
                         cwd=ROOT, capture_output=True, text=True, timeout=1700)
    said = [line for line in run.stdout.splitlines() + run.stderr.splitlines()
            if line.startswith("build-images:")]
    assert run.returncode == 0, "\n".join(said) + "\n" + run.stderr[-3000:]
    assert said[-1] == "build-images: all checks passed", said
    compiled = re.search(r"^(\d+) compiled modules; redis \S+; resume stores: (.*)$", run.stdout,
                         re.MULTILINE)
    assert compiled is not None and int(compiled[1]) > 0, run.stdout[-3000:]
    # --resume-store works in the container, in each topology (the redis extra is in the image).
    assert compiled[2] == "redis, redis+sentinel, redis+cluster", compiled[2]
    assert any(re.fullmatch(r"build-images: tokenwire-sidecar:\S+: \d+ MB", line) for line in said), said
    assert any(line.startswith("build-images: sidecar: proxied a stream of ") for line in said), said
