"""Fake engine pods as real processes: the launcher is the balancing
benchmark's (``bench/fake_pods.py``, beside the fake engine it starts), so the
benchmark and these tests start pods one way."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
from fake_pods import FakePod, spawn_pod

__all__ = ["FakePod", "spawn_pod"]
