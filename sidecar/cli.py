"""The ``tokenwire`` command: ``sidecar``, ``engine``, ``up``, ``demo``, ``probe``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from tokenwire.middleware import ConfigError
from tokenwire.middleware.config import load_toml

from .settings import SIDECAR_WIRE_DEFAULTS, SidecarConfig, all_keys, build_config

USAGE = """\
usage: tokenwire <command> [options]

commands:
  sidecar   reverse proxy in front of an OpenAI-compatible engine (tokenwire sidecar --help)
  engine    the embedded torch + transformers engine (needs tokenwire[engine])
  up        engine (tiny) + sidecar together, for trying it out
  demo      the guided tour
  probe     load and correctness probe against a URL
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tokenwire`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "sidecar":
        return sidecar_main(rest)
    if command == "engine":
        return _engine_main(rest)
    if command == "probe":
        return _probe_main(rest)
    if command == "up":
        from .up import main as up_main

        return up_main(rest)
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"tokenwire: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def _engine_main(argv: list[str]) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("tokenwire engine needs torch: pip install tokenwire[engine]", file=sys.stderr)
        return 2
    # Imported late: the engine pulls in torch, which the sidecar never needs.
    from tokenwire.engine.server import main as engine_main  # type: ignore[import-not-found,unused-ignore]

    return int(engine_main(argv))


def _probe_main(argv: list[str]) -> int:
    from .probe import main as probe_main

    return probe_main(argv)


def _defaults() -> dict[str, object]:
    wire = SIDECAR_WIRE_DEFAULTS
    values: dict[str, object] = {f.name: getattr(wire, f.name) for f in dataclasses.fields(wire)}
    for f in dataclasses.fields(SidecarConfig):
        if f.name != "wire":
            values[f.name] = f.default
    return values


def sidecar_parser() -> argparse.ArgumentParser:
    """The ``tokenwire sidecar`` parser: one flag per configuration key."""
    parser = argparse.ArgumentParser(
        prog="tokenwire sidecar",
        description="Reverse proxy that owns the wire between an OpenAI-compatible engine and its "
                    "clients. Every option is also a TOKENWIRE_* environment variable and a key of "
                    "the --config TOML file; precedence: flag > environment > file > default.",
        argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="TOML file (see conf/sidecar.toml)")
    defaults = _defaults()
    for key in all_keys():
        default = defaults[key.name]
        shown = "none" if default in (None, "", ()) else (getattr(default, "value", default))
        help_text = f"{key.help} [{key.env}; default {shown}]".strip()
        metavar = key.name.upper()
        if key.name == "upstream":
            parser.add_argument(key.flag, dest=key.name, action="append", metavar="URL",
                                help=f"{key.help} Repeat for fallbacks. [{key.env}, comma-separated]")
        elif key.name == "cors_allow_origins":
            # Given once per origin, so the singular reads right on a command line.
            parser.add_argument(key.flag, "--cors-allow-origin", dest=key.name, action="append",
                                metavar="ORIGIN", help=f"{key.help} Repeatable. [{key.env}, comma-separated]")
        elif key.kind is bool:
            # A switch, as users expect of --resume; --no-resume undoes an env/file value.
            parser.add_argument(key.flag, dest=key.name, action="store_const", const="true",
                                help=help_text)
            parser.add_argument("--no-" + key.flag[2:], dest=key.name, action="store_const",
                                const="false", help=argparse.SUPPRESS)
        else:
            parser.add_argument(key.flag, dest=key.name, metavar=metavar, help=help_text)
    return parser


def load_sidecar_config(argv: Sequence[str], environ: dict[str, str] | None = None) -> SidecarConfig:
    """Parse flags, read the environment and the ``--config`` file; merge them."""
    namespace = vars(sidecar_parser().parse_args(list(argv)))
    config_path = namespace.pop("config", None) or (environ or {}).get("TOKENWIRE_CONFIG")
    file_values = load_toml(config_path) if config_path else {}
    return build_config(flags=namespace, environ=environ, file_values=file_values)


def sidecar_main(argv: Sequence[str]) -> int:
    """``tokenwire sidecar``: build the config, then serve until SIGTERM."""
    try:
        config = load_sidecar_config(argv, dict(os.environ))
    except ConfigError as error:
        print(f"tokenwire sidecar: configuration error: {error}", file=sys.stderr)
        return 2
    from .server import run

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(config)
    except ConfigError as error:
        print(f"tokenwire sidecar: configuration error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"tokenwire sidecar: cannot start: {error}", file=sys.stderr)
        return 1
