"""A program that cannot start says why in one line and exits non-zero at once.

Each case runs the real console entry point (``python -m tokenwire sidecar`` /
``engine``) in a child process with one thing wrong, and reads what a
supervisor would log: the exit status and stderr. The line must name what to
fix (the file, the variable, the key, the address) and carry no traceback.
The engine's busy port and missing socket directory are in
tests/engine/test_config.py (they need a model path that is never loaded).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

Case = Callable[[Path], tuple[list[str], dict[str, str], list[str]]]


def _run(argv: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TOKENWIRE_")}
    return subprocess.run([sys.executable, "-m", "tokenwire", *argv], capture_output=True, text=True,
                          timeout=60, env={**env, **environ})


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        yield busy.getsockname()[1]


def _pem_files(folder: Path) -> tuple[Path, Path, Path]:
    """A certificate, its key, and another certificate's key."""
    authority = trustme.CA()
    served, other = authority.issue_cert("localhost"), authority.issue_cert("elsewhere")
    cert, key, other_key = folder / "cert.pem", folder / "key.pem", folder / "other-key.pem"
    served.cert_chain_pems[0].write_to_path(str(cert))
    served.private_key_pem.write_to_path(str(key))
    other.private_key_pem.write_to_path(str(other_key))
    return cert, key, other_key


def _sidecar(*flags: str) -> list[str]:
    # --max-connections within any open-file limit: its warning is not the line under test.
    return ["sidecar", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
            "--admin-listen", "127.0.0.1:0", "--max-connections", "100", *flags]


def _tls(folder: Path, which: str) -> tuple[list[str], dict[str, str], list[str]]:
    cert, key, other_key = _pem_files(folder)
    garbage, absent = folder / "garbage.pem", folder / "absent.pem"
    garbage.write_text("not a PEM file\n")
    chosen = {"cert": (garbage, key, ["tls_cert", str(garbage), "no PEM certificate"]),
              "key": (cert, garbage, ["tls_key", str(garbage), "no PEM private key"]),
              "mismatch": (cert, other_key, ["tls_key", str(other_key), "not the private key", str(cert)]),
              "missing": (cert, absent, ["tls_key", str(absent), "no such file"])}
    cert_path, key_path, says = chosen[which]
    return _sidecar("--tls-cert", str(cert_path), "--tls-key", str(key_path)), {}, says


def _toml_key(folder: Path) -> tuple[list[str], dict[str, str], list[str]]:
    config = folder / "sidecar.toml"
    config.write_text('upstream = ["http://127.0.0.1:9"]\nheartbeat = 3\n')
    return (["sidecar", "--config", str(config)], {},
            ["heartbeat", str(config), "did you mean heartbeat_s?"])


def _toml_value(folder: Path) -> tuple[list[str], dict[str, str], list[str]]:
    config = folder / "engine.toml"
    config.write_text('max_running = "many"\n')
    return ["engine", "--config", str(config)], {}, ["max_running", f"in {config}"]


def _unreadable(folder: Path) -> tuple[list[str], dict[str, str], list[str]]:
    # A folder where the file should be: unreadable as a file even for root,
    # which a chmod 000 file is not.
    return _sidecar("--config", str(folder)), {}, ["config", f"cannot read {folder}"]


def _env_value(folder: Path) -> tuple[list[str], dict[str, str], list[str]]:
    return (_sidecar(), {"TOKENWIRE_HEARTBEAT_S": "abc"},
            ["heartbeat_s", "TOKENWIRE_HEARTBEAT_S='abc'"])


def _no_upstream(folder: Path) -> tuple[list[str], dict[str, str], list[str]]:
    return ["sidecar", "--listen", "127.0.0.1:0", "--max-connections", "100"], {}, ["upstream", "--upstream"]


CASES: dict[str, Case] = {
    "unknown TOML key": _toml_key,
    "bad TOML value (engine)": _toml_value,
    "unreadable config": _unreadable,
    "bad env value": _env_value,
    "no upstream": _no_upstream,
    **{f"bad PEM ({which})": (lambda folder, which=which: _tls(folder, which))
       for which in ("cert", "key", "mismatch", "missing")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_start_up_error_when_refused_then_one_line_names_what_to_fix(tmp_path: Path, case: str) -> None:
    argv, environ, says = CASES[case](tmp_path)
    result = _run(argv, environ)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert all(part in lines[0] for part in says), (says, lines[0])
    assert "Traceback" not in result.stderr


def test_sidecar_that_cannot_listen_says_where_in_one_line(busy_port: int) -> None:
    """As the engine: the address and the system's reason, one line, exit 1."""
    result = _run([*_sidecar(), "--listen", f"127.0.0.1:{busy_port}"], {})
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == ("tokenwire sidecar: cannot start: "
                                     f"cannot listen on 127.0.0.1:{busy_port}: Address already in use")


def test_ready_line_when_ipv6_then_hosts_in_brackets() -> None:
    """``::1:8080`` reads as a host and no port to anything that splits on the
    last colon of a URL; the ready line writes it as ``[::1]:8080``, as URLs do."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with subprocess.Popen([sys.executable, "-m", "tokenwire", "sidecar", "--upstream", "http://127.0.0.1:9",
                           "--listen", "[::1]:0", "--admin-listen", "[::1]:0", "--max-connections", "100"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            ready = child.stdout.readline()
        finally:
            child.terminate()
            child.communicate(timeout=30)
    assert ready.startswith("ready listen=[::1]:") and " admin=[::1]:" in ready, ready


_FD_LIMIT_CHILD = """
import logging, resource, sys
from tokenwire.sidecar.process.server import raise_fd_limit
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
print(raise_fd_limit(1000), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


@pytest.mark.parametrize(("soft", "hard", "expected"), [(512, 4096, 2256), (512, 1024, 1024)])
def test_open_file_limit_when_low_then_raised_to_need_or_hard_limit_with_advice(
        soft: int, hard: int, expected: int) -> None:
    """As nginx's ``worker_rlimit_nofile``: the soft limit goes up to what
    ``max_connections`` needs (two descriptors a stream); where the hard limit
    is lower, one line says what to run. Run in a child: a lowered hard limit
    cannot be raised again."""
    result = subprocess.run([sys.executable, "-c", _FD_LIMIT_CHILD, str(soft), str(hard)],
                            capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == [str(expected)] * 2
    if expected == 2256:
        assert result.stderr == ""
    else:
        assert "hard limit 1024" in result.stderr and "ulimit -Hn 2256" in result.stderr
        assert "--max-connections 384" in result.stderr


@pytest.mark.parametrize("entry", [["-m", "tokenwire", "engine"], ["-m", "tokenwire.engine.server"]])
def test_engine_that_cannot_listen_says_so_before_importing_torch(busy_port: int, entry: list[str]) -> None:
    """Importing torch alone takes a second and more: a start-up that is going
    to fail says so first (issue 37: "exits non-zero within 2 s")."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TOKENWIRE_")}
    argv = [sys.executable, "-X", "importtime", *entry, "--listen", f"127.0.0.1:{busy_port}"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    imported = [line.rpartition("|")[2].strip() for line in result.stderr.splitlines()
                if "import time:" in line]
    assert "tokenwire.engine.cli" in imported or "tokenwire.engine.server" in imported
    assert "torch" not in imported and "transformers" not in imported
    assert f"cannot listen on 127.0.0.1:{busy_port}: Address already in use" in result.stderr
