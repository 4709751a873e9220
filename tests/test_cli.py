"""The ``tokenwire`` command: subcommands, help for every flag, --version,
``python -m tokenwire``, and an ``engine --help`` that never loads torch."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenwire.engine.config import engine_keys
from tokenwire.sidecar.settings import all_keys

from tokenwire.tools.cli import COMMANDS, build_parser, main, subcommand_parsers

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_has_a_docstring() -> None:
    """The help of a generated flag is its dataclass field's docstring."""
    missing = [key.name for key in all_keys() if not key.help.strip()]
    missing += [key.name for key in engine_keys() if not key.help.strip()]
    assert missing == []


def test_every_flag_of_every_subcommand_has_help() -> None:
    subparsers = subcommand_parsers(build_parser())
    assert set(subparsers) == {c.name for c in COMMANDS} | {"help"}
    for name, parser in subparsers.items():
        actions = [a for a in parser._actions if a.help != argparse.SUPPRESS]
        assert len(actions) > 1 or name == "help", name
        for action in actions:
            text = (action.help or "").split("[")[0].strip()  # the part before "[VARIABLE; default]"
            assert text, f"tokenwire {name} {'/'.join(action.option_strings) or action.dest}: no help"


def test_hidden_switch_negations_are_named_in_their_switch_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sidecar", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-resume turns it off" in out
    assert "{coalesce,drop,block}" in out


def test_terminal_marker_help_shows_what_to_type(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sidecar", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    out = out[out.index("options:"):]
    marker = out[out.index("--terminal-marker TERMINAL_MARKER"):]
    marker = marker[:marker.index("--socket-send-buffer-bytes")]
    assert "empty ('';" in marker and "``" not in marker
    assert "default auto" in marker
    assert "default ''" in out[out.index("--admin-listen ADMIN_LISTEN"):]


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_help_command_is_the_command_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help", command]) == 0
    via_help = capsys.readouterr().out
    assert main([command, "--help"]) == 0
    assert capsys.readouterr().out == via_help
    assert via_help.startswith(f"usage: tokenwire {command}")


def test_help_without_a_command_lists_them_and_bad_ones_fail(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in COMMANDS)
    assert main(["help", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["probe"]) == 2  # its URL is required: argparse's usage error, as a status
    assert "TARGET" in capsys.readouterr().err
    # A check the command makes itself, after the flags parsed: still a status, not an exit.
    assert main(["probe", "http://127.0.0.1:9", "--concurrency", "0"]) == 2
    assert "--concurrency and --requests must be >= 1" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tokenwire {importlib.metadata.version('tokenwire')}"


def test_short_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-V"]) == 0
    assert capsys.readouterr().out.strip() == f"tokenwire {importlib.metadata.version('tokenwire')}"


@pytest.mark.parametrize("command", ["sidecar", "up", "demo", "probe"])
def test_unknown_flag_when_given_then_the_commands_own_usage_and_status_2(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--no-such-flag", "http://127.0.0.1:1"]) == 2  # probe takes the URL as its TARGET
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tokenwire {command} "), err[:300]
    assert f"tokenwire {command}: error: unrecognized arguments: --no-such-flag" in err, err[-300:]


def test_flag_prefix_when_given_then_refused_not_taken_for_the_longer_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--heartbeat 5`` would otherwise set ``heartbeat_s`` silently (argparse's prefix matching)."""
    assert main(["sidecar", "--upstream", "http://127.0.0.1:1", "--heartbeat", "5"]) == 2
    assert "unrecognized arguments: --heartbeat 5" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_tokenwire_is_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "tokenwire", "--version"], capture_output=True,
                            text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tokenwire ")
    listing = subprocess.run([sys.executable, "-m", "tokenwire", "help"], capture_output=True,
                             text=True, timeout=60, cwd="/")
    assert listing.returncode == 0 and "probe" in listing.stdout


@pytest.mark.slow
def test_engine_help_does_not_import_torch() -> None:
    """``tokenwire engine --help`` reads the flags off the config alone: no torch,
    no transformers, no web stack. The time bound is generous (a busy machine);
    importing torch alone takes seconds, which the import list catches anyway."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tokenwire", "engine", "--help"],
                            capture_output=True, text=True, timeout=60, cwd="/")
    elapsed_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "--max-prefill-tokens-per-step" in result.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "tokenwire" in imported  # the import list is real
    assert not imported & {"torch", "transformers", "starlette", "uvicorn"}
    assert elapsed_s < 10, elapsed_s
