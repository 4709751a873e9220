"""The ``tokenwire engine`` command line, without the engine.

This module imports neither torch nor the web stack, so ``tokenwire engine
--help`` and a bad flag or config file answer at once, and the ``tokenwire``
command can describe the engine on an install without the engine extra.
``server.py`` loads the model once the flags have been read.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from tokenwire.engine.config import CONFIG_ENV, EngineConfig, build_engine_config, engine_keys
from tokenwire.middleware.process.config_layers import add_key_flags, config_defaults, read_command_line

SUMMARY = "the embedded torch + transformers engine (needs the engine extra)"
DESCRIPTION = (
    "Serve a causal LM over an OpenAI-compatible API with continuous batching. "
    "Every option is also a TOKENWIRE_ENGINE_* environment variable and a key of the "
    "--config TOML file; precedence: flag > environment > file > default."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per :class:`EngineConfig` key.

    Flags default to "not given" (``SUPPRESS``) so that an absent flag leaves
    the environment, the file or the built-in default in charge; they are
    spelt as the sidecar's (``add_key_flags``).
    """
    parser.description = DESCRIPTION
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help=f"TOML file (see conf/engine.toml) [{CONFIG_ENV}]")
    add_key_flags(parser, engine_keys(), config_defaults(EngineConfig))


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenwire engine`` parser on its own (``python -m tokenwire.engine.server``)."""
    parser = argparse.ArgumentParser(prog="tokenwire engine", allow_abbrev=False)
    add_arguments(parser)
    return parser


def load_engine_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Parse flags, read the environment and the ``--config`` file; merge them."""
    flags, file_values, file_path = read_command_line(build_parser(), argv, environ, CONFIG_ENV)
    return build_engine_config(flags=flags, environ=environ, file_values=file_values, file_path=file_path)
