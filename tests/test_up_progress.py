"""What ``tokenwire up`` (and so ``tokenwire demo``) shows while the engine starts.

The engine's output goes to a pipe, and its logs are JSON: without a relay a
newcomer saw one line for the minute the first build takes. Its build's stage
lines are relayed as text; everything else stays behind ``--verbose``. And
"it is built first" is said only when the model is not built yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tokenwire.engine.tiny import tiny_model_path

from tokenwire.tools import up

_PROGRESS = "building the tiny model (first run only) [###...] 10% loss 5.10, 6s, ~54s left"
_LINES = [
    json.dumps({"level": "info", "logger": "tokenwire.engine", "msg": _PROGRESS}),
    json.dumps({"level": "info", "logger": "uvicorn.error", "msg": "Started server process [1]"}),
    "a line that is not JSON",
    json.dumps({"level": "info", "logger": "tokenwire.engine", "msg": "built the tiny model in 61.0s at /c"}),
]


@pytest.mark.parametrize("echo", [False, True])
def test_child_output_when_not_verbose_then_only_build_progress_is_shown(
        echo: bool, capfd: pytest.CaptureFixture[str]) -> None:
    script = "import sys\n" + "".join(f"print({line!r})\n" for line in _LINES)
    child = up.Child("engine", [sys.executable, "-c", script], echo=echo,
                     relay=("building the tiny model", "built the tiny model"))
    assert child.process.wait(60) == 0
    child.pump.join(60)
    shown = capfd.readouterr().err.splitlines()
    if echo:
        assert shown == [f"[engine] {line}" for line in _LINES]
    else:
        assert shown == [f"[engine] {_PROGRESS}", "[engine] built the tiny model in 61.0s at /c"]


def test_first_run_line_when_model_built_then_not_said(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``up`` reads the engine's cache (``TOKENWIRE_CACHE_DIR``) to know."""
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path))
    assert not up._tiny_built()
    folder = tiny_model_path()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert up._tiny_built()
