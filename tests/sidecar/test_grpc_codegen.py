"""The committed code in tokenwire/v1 is what grpcio-tools makes of streaming.proto.

Generated code is committed (so installing tokenwire needs no protoc); this
check regenerates it and compares. Only the lines naming the protoc/grpc
versions that made it may differ: they say which runtime it needs, not what
the .proto says.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("streaming_pb2.py", "streaming_pb2.pyi", "streaming_pb2_grpc.py")
_VERSION_LINES = re.compile(
    rb"^(# Protobuf Python Version: .*|    \d+,|GRPC_GENERATED_VERSION = .*)$", re.MULTILINE)


def _normalised(data: bytes) -> bytes:
    return _VERSION_LINES.sub(b"<version>", data)


@pytest.mark.slow
def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "out"
    (out / "tokenwire" / "v1").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", str(ROOT / "tokenwire/v1/streaming.proto")],
        check=True, capture_output=True)
    for name in GENERATED:
        fresh = (out / "tokenwire/v1" / name).read_bytes()
        committed = (ROOT / "tokenwire/v1" / name).read_bytes()
        assert _normalised(fresh) == _normalised(committed), (
            f"tokenwire/v1/{name} is stale: regenerate it (see tokenwire/v1/__init__.py)")


def test_a_stale_file_would_be_caught(tmp_path: Path) -> None:
    """The comparison sees a change to the descriptor (a renamed field)."""
    committed = (ROOT / "tokenwire/v1/streaming_pb2.py").read_bytes()
    changed = committed.replace(b"chunk_json", b"chunk_jsn", 1)
    assert _normalised(changed) != _normalised(committed)
