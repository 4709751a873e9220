"""Building the embedded tiny model: once, atomically, reused after."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
from tokenwire.engine.tiny import TinySpec, ensure_tiny_model

MINIMAL = TinySpec(vocab_size=600, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=1, max_position_embeddings=256, train_steps=2, batch_size=2,
                   sequence_length_tokens=16)


def test_the_tiny_model_folder_is_a_normal_hugging_face_folder(tiny_model_dir: Path) -> None:
    names = {path.name for path in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["max_position_embeddings"] >= 8192


def test_concurrent_builders_build_once_and_never_expose_a_partial_folder(
    tmp_path: Path,
) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(MINIMAL, tmp_path,
                                                                          log=False)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == 2 and results[0] == results[1]
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folders == [results[0]]  # no staging folder left behind
    mtime = (results[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(MINIMAL, tmp_path, log=False) == results[0]
    assert (results[0] / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_a_first_build_shows_a_progress_bar_that_ends_at_100_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    ensure_tiny_model(MINIMAL, tmp_path, log=True)
    err = capsys.readouterr().err
    assert "building the tiny model" in err
    assert "100%" in err.splitlines()[-1]
    ensure_tiny_model(MINIMAL, tmp_path, log=True)
    assert "building" not in capsys.readouterr().err  # cached: no bar, no build


def test_a_first_build_when_said_to_a_log_then_a_line_per_stage_and_none_when_cached(tmp_path: Path) -> None:
    """The engine's JSON logs get the build as lines (``tokenwire up`` relays
    them); the model already built says nothing, and is known to be built."""
    from tokenwire.engine.tiny import tiny_model_path

    spec = dataclasses.replace(MINIMAL, train_steps=20)
    assert not (tiny_model_path(spec, tmp_path) / "config.json").exists()
    said: list[str] = []
    folder = ensure_tiny_model(spec, tmp_path, log=False, say=said.append)
    assert folder == tiny_model_path(spec, tmp_path) and (folder / "config.json").exists()
    assert said[0].startswith("building the tiny model (first run only") and str(folder) in said[0]
    progress = [line for line in said[1:-1] if line.startswith("building the tiny model (first run only) [")]
    assert len(progress) >= 5 and "100%" in progress[-1]
    assert said[-1].startswith("built the tiny model in ")
    said.clear()
    assert ensure_tiny_model(spec, tmp_path, log=False, say=said.append) == folder
    assert said == []


def test_default_temperature_is_what_the_folder_says(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tokenwire.engine.loader import _default_temperature

    assert _default_temperature(tiny_model_dir) == 0.0  # tiny: do_sample false
    assert _default_temperature(tmp_path) == 1.0         # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True,
                                                                 "temperature": 0.6}))
    assert _default_temperature(tmp_path) == 0.6
