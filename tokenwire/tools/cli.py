"""The ``tokenwire`` command: ``sidecar``, ``engine``, ``up``, ``demo``, ``probe``, ``drain``,
``help``.

One argparse parser with a subcommand each. A subcommand's flags come from the
module that runs it (``add_arguments``), and the configuration keys of the
sidecar and the engine come from their config dataclasses, so a new key gets
its flag, its variable and its help text without an edit here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import cast

from tokenwire.middleware import ConfigError
from tokenwire.middleware.process.config_layers import add_key_flags, config_defaults, read_command_line
from tokenwire.sidecar.settings import SidecarConfig, all_keys, build_config

DESCRIPTION = (
    "Reverse proxy that owns the wire between an OpenAI-compatible engine and its clients. "
    "Every option is also a TOKENWIRE_* environment variable and a key of the --config TOML "
    "file; precedence: flag > environment > file > default."
)


@dataclass(frozen=True, slots=True)
class Command:
    """One ``tokenwire`` subcommand, its functions named as ``module:function``.

    Named rather than imported, so ``tokenwire`` imports only the command it
    runs: ``tokenwire engine --help`` must not load torch, nor ``tokenwire
    --help`` any of the tools.
    """

    name: str
    summary: str
    arguments: str
    """``add_arguments(parser)``: fills the subcommand's parser."""
    entry: str
    """``main(argv) -> int``: runs the command on the words after its name."""


COMMANDS = (
    Command("sidecar", "reverse proxy in front of an OpenAI-compatible engine",
            "tokenwire.tools.cli:add_arguments", "tokenwire.tools.cli:sidecar_main"),
    Command("engine", "the embedded torch + transformers engine (needs the engine extra)",
            "tokenwire.engine.cli:add_arguments", "tokenwire.tools.cli:engine_main"),
    Command("up", "engine (tiny) + sidecar together, for trying it out",
            "tokenwire.tools.up:add_arguments", "tokenwire.tools.up:main"),
    Command("demo", "the guided tour: live streams, a slow reader, a dropped connection, a resume",
            "tokenwire.tools.demo:add_arguments", "tokenwire.tools.demo:main"),
    Command("probe", "what a client sees on a stream: time to first token, gaps, truncation",
            "tokenwire.tools.probe:add_arguments", "tokenwire.tools.probe:main"),
    Command("drain", "drain a running sidecar and wait for its streams (a Kubernetes preStop)",
            "tokenwire.tools.drain:add_arguments", "tokenwire.tools.drain:main"),
)
_BY_NAME = {command.name: command for command in COMMANDS}


def _resolve(reference: str) -> Callable[..., object]:
    module, _, name = reference.partition(":")
    return cast(Callable[..., object], getattr(importlib.import_module(module), name))


def version() -> str:
    """The installed distribution's version."""
    try:
        return importlib.metadata.version("tokenwire")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        return "unknown"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``tokenwire`` parser: one subcommand per :data:`COMMANDS` entry, and ``help``.

    Only the subcommands named in ``commands`` (default: all) get their flags,
    which imports their modules; the others are listed with their summary.
    """
    parser = argparse.ArgumentParser(
        prog="tokenwire", allow_abbrev=False,
        description="The wire between LLM engines and the people reading their answers. "
                    "`tokenwire help COMMAND` or `tokenwire COMMAND --help` lists a command's options.")
    parser.add_argument("-V", "--version", action="version", version=f"tokenwire {version()}",
                        help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for command in COMMANDS:
        # No prefix matching (``--heartbeat 5`` is not ``--heartbeat-s 5``), as in every parser here.
        sub = subparsers.add_parser(command.name, help=command.summary, description=command.summary,
                                    allow_abbrev=False)
        if commands is None or command.name in commands:
            _resolve(command.arguments)(sub)
    helper = subparsers.add_parser("help", help="show a command's options",
                                   description="Show a command's options, or the list of commands.")
    helper.add_argument("topic", nargs="?", metavar="COMMAND", choices=list(_BY_NAME),
                        help=f"one of {', '.join(_BY_NAME)}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tokenwire`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        build_parser(()).print_help(sys.stderr)
        return 2
    first = args[0]
    if not first.startswith("-") and first != "help" and first not in _BY_NAME:
        print(f"tokenwire: unknown command {first!r} (one of {', '.join(_BY_NAME)}, help)",
              file=sys.stderr)
        return 2
    if first == "help":
        # ``tokenwire help engine`` is ``tokenwire engine --help``.
        args = [*args[1:2], "--help"] if len(args) > 1 and args[1] in _BY_NAME else args
        first = args[0]
    parser = build_parser([first] if first in _BY_NAME else ())
    try:
        namespace, unknown = parser.parse_known_args(args)
        if unknown:
            # The command's own usage, not the top level's (argparse hands a
            # subcommand's unknown flags up to the parser above it).
            command_parser = subcommand_parsers(parser).get(namespace.command or "", parser)
            command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as stop:  # --help, --version or a usage error, already printed
        return _status(stop)
    if namespace.command in (None, "help"):
        parser.print_help()
        return 0
    # The flags are good (checked above); the command reads them again itself, so
    # ``tokenwire engine ...`` and ``python -m tokenwire.engine.server ...`` are one path.
    try:
        return cast(int, _resolve(_BY_NAME[namespace.command].entry)(args[1:]))
    except SystemExit as stop:  # a command's own usage error (argparse exits)
        return _status(stop)


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each subcommand of :func:`build_parser`'s ``parser``, by name."""
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _status(stop: SystemExit) -> int:
    """The exit status a ``SystemExit`` carries (``sys.exit("message")`` is 1)."""
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 1


def engine_main(argv: Sequence[str]) -> int:
    """``tokenwire engine``: say how to install torch if it is missing, else serve."""
    # Found, not imported: importing torch takes a second and more, and a
    # start-up that fails (a busy port) must say so at once (the engine listens first).
    if importlib.util.find_spec("torch") is None:
        print("tokenwire engine needs torch (the engine extra): "
              "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, "
              "then pip install '.[engine]' in tokenwire's clone (README: Install)", file=sys.stderr)
        return 2
    # Imported late: the engine pulls in torch, which the sidecar never needs.
    from tokenwire.engine.server import main as serve  # type: ignore[import-not-found,unused-ignore]

    return int(serve(list(argv)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tokenwire sidecar`` flags: ``--config`` and one per configuration key."""
    parser.description = DESCRIPTION
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file (see conf/sidecar.toml) [TOKENWIRE_CONFIG]")
    # Given once per origin, so the singular reads right on a command line.
    add_key_flags(parser, all_keys(), config_defaults(SidecarConfig),
                  metavars={"upstream": "URL", "cors_allow_origins": "ORIGIN"},
                  aliases={"cors_allow_origins": "--cors-allow-origin"},
                  notes={"upstream": "Repeat for fallbacks."})


def sidecar_parser() -> argparse.ArgumentParser:
    """The ``tokenwire sidecar`` parser on its own."""
    parser = argparse.ArgumentParser(prog="tokenwire sidecar", allow_abbrev=False)
    add_arguments(parser)
    return parser


def load_sidecar_config(argv: Sequence[str], environ: dict[str, str] | None = None) -> SidecarConfig:
    """Parse flags, read the environment and the ``--config`` file; merge them."""
    return _sidecar_config_and_file(argv, environ)[0]


def _sidecar_config_and_file(argv: Sequence[str],
                             environ: dict[str, str] | None) -> tuple[SidecarConfig, str | None]:
    """:func:`load_sidecar_config`, and the path of the file it read (None: no file)."""
    flags, file_values, file_path = read_command_line(sidecar_parser(), argv, environ, "TOKENWIRE_CONFIG")
    return build_config(flags=flags, environ=environ, file_values=file_values, file_path=file_path), file_path


def sidecar_main(argv: Sequence[str]) -> int:
    """``tokenwire sidecar``: build the config, then serve until SIGTERM."""
    try:
        config, config_file = _sidecar_config_and_file(argv, dict(os.environ))
    except ConfigError as error:
        print(f"tokenwire sidecar: configuration error: {error}", file=sys.stderr)
        return 2
    from tokenwire.middleware.process.logs import configure_logging
    from tokenwire.sidecar.process.server import run
    from tokenwire.sidecar.process.workers import WORKER_ENV, die_with_parent, supervise

    configure_logging(config.log_level, config.log_format)
    worker = WORKER_ENV in os.environ
    if worker:
        die_with_parent()
    try:
        if config.worker_count > 1 and not worker:
            return supervise(config, argv)
        return run(config, reuse_port=worker, config_file=config_file)
    except ConfigError as error:
        print(f"tokenwire sidecar: configuration error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        print(f"tokenwire sidecar: cannot start: {error.strerror or error}{where}", file=sys.stderr)
        return 1
