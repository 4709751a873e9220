"""A program's configuration keys as flags, environment variables and TOML keys, from its dataclass.

The sidecar (``tokenwire.sidecar.settings``) and the engine
(``tokenwire.engine.config``) each hold one frozen dataclass with a ``wire``
field (a :class:`~tokenwire.middleware.WireConfig`) beside their own keys. This
module turns such a dataclass into its keys (the wire core's first) and builds
it back from the layers, flag > environment > file > default, so the two
programs read every key the same way: ``heartbeat_s`` is ``--heartbeat-s``,
``<PREFIX>HEARTBEAT_S`` and ``heartbeat_s = 15.0``, and a bad value is a
:class:`~tokenwire.middleware.ConfigError` naming the key.

Types a key may have: ``bool``, ``int``, ``float``, ``str``, an ``Enum``,
``tuple[str, ...]`` (a comma list in text, a list in TOML), ``str | None`` and
``int | None``. TOML has no null, so an optional key is unset by an empty
string (or 0 for a number), and so it is in a flag or a variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, TypeVar

from ..core.config import (
    ConfigError,
    WireConfig,
    field_docs,
    load_toml,
    merge_layers,
    parse_bool,
)

_OPTIONAL_KINDS = (str | None, int | None)


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One configuration key: its type, help text, flag, variable and where it lands."""

    name: str
    kind: Any
    """The field's type (see the module docstring)."""
    help: str
    wire: bool
    """A key of :class:`WireConfig` (lands in ``config.wire``)."""
    env_prefix: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.env_prefix + self.name.upper()

    @property
    def optional(self) -> bool:
        """Unset (None) by an empty value, or 0 for a number: TOML has no null."""
        return self.kind in _OPTIONAL_KINDS


def config_keys(config_class: type, env_prefix: str) -> list[ConfigKey]:
    """Every key of ``config_class``: the wire core's first, then its own (all but ``wire``)."""
    keys: list[ConfigKey] = []
    for cls, wire in ((WireConfig, True), (config_class, False)):
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        keys.extend(ConfigKey(f.name, hints[f.name], docs.get(f.name, ""), wire, env_prefix)
                    for f in dataclasses.fields(cls) if f.name != "wire")
    return keys


def kind_name(kind: Any) -> str:
    """A key's type as an error message says it."""
    if kind is bool:
        return "boolean (true/false)"
    if kind in (int, int | None):
        return "whole number"
    if kind is float:
        return "number"
    if kind == tuple[str, ...]:
        return "list of strings"
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "one of " + ", ".join(str(member.value) for member in kind)
    if isinstance(kind, types.UnionType) or kind is str:
        return "string"
    return getattr(kind, "__name__", str(kind))


def value_from_text(key: ConfigKey, text: str) -> object:
    """A flag's or a variable's value (always text) as the key's type."""
    kind = key.kind
    if key.optional and text.strip() == "":
        return None
    try:
        if kind is bool:
            return parse_bool(key.name, text)
        if kind is float:
            return float(text)
        if kind in (int, int | None):
            value = int(text)
            return None if key.optional and value == 0 else value
        if isinstance(kind, type) and issubclass(kind, Enum):
            return kind(text)
    except ValueError:
        raise ConfigError(key.name, f"not a valid {kind_name(kind)}: {text!r}") from None
    if kind == tuple[str, ...]:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


def value_from_toml(key: ConfigKey, value: object) -> object:
    """A TOML value, type-checked against the key."""
    kind = key.kind
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        ok = False
    elif kind in (int, int | None):
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and key.optional and value == 0:
            return None
    elif kind == tuple[str, ...]:
        names = [value] if isinstance(value, str) else value
        ok = isinstance(names, list) and all(isinstance(name, str) for name in names)
        value = tuple(typing.cast(list[str], names)) if ok else value
    else:
        ok = isinstance(value, str)
        if ok and isinstance(kind, type) and issubclass(kind, Enum):
            return value_from_text(key, typing.cast(str, value))
        if ok and key.optional and value == "":
            return None
    if not ok:
        raise ConfigError(key.name, f"must be a {kind_name(kind)}, got {value!r}")
    return value


def shown_default(key: ConfigKey, default: object) -> str:
    """A default as one would type it: ``''`` for an empty or unset string."""
    if default is None and key.kind == int | None:
        return "derived"
    if default in (None, ""):
        return "''"
    if default == ():
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default.value if isinstance(default, Enum) else default)


def add_key_flags(parser: argparse.ArgumentParser, keys: list[ConfigKey], defaults: Mapping[str, object],
                  *, metavars: Mapping[str, str] = MappingProxyType({}),
                  aliases: Mapping[str, str] = MappingProxyType({}),
                  notes: Mapping[str, str] = MappingProxyType({})) -> None:
    """One flag per key, its help the field's docstring with its variable and default.

    Flags default to "not given" (``SUPPRESS``), so an absent flag leaves the
    environment, the file or the built-in default in charge. A ``bool`` key is
    a switch with a hidden ``--no-`` form (it undoes an environment or file
    value); a ``tuple[str, ...]`` key may be repeated (or given a comma list).
    ``metavars``, ``aliases`` (a second spelling) and ``notes`` (help text to
    add) are by key name.
    """
    suppress = argparse.SUPPRESS
    for key in keys:
        described = key.help.replace("``", "")  # reStructuredText literals read as plain text
        if key.name in notes:
            described = f"{described} {notes[key.name]}"
        where = f"[{key.env}; default {shown_default(key, defaults[key.name])}]"
        spellings = [key.flag, *([aliases[key.name]] if key.name in aliases else [])]
        metavar = metavars.get(key.name, key.name.upper())
        if key.kind is bool:
            switch_help = f"{described} --no-{key.flag[2:]} turns it off. {where}"
            parser.add_argument(*spellings, dest=key.name, action="store_const", const="true",
                                default=suppress, help=switch_help)
            parser.add_argument("--no-" + key.flag[2:], dest=key.name, action="store_const",
                                const="false", default=suppress, help=suppress)
        elif key.kind == tuple[str, ...]:
            list_help = f"{described} Repeatable. [{key.env}, comma-separated]"
            parser.add_argument(*spellings, dest=key.name, action="append", metavar=metavar,
                                default=suppress, help=list_help)
        elif isinstance(key.kind, type) and issubclass(key.kind, Enum):
            choices = ",".join(str(member.value) for member in key.kind)
            parser.add_argument(*spellings, dest=key.name, metavar=f"{{{choices}}}", default=suppress,
                                help=f"{described} {where}")
        else:
            parser.add_argument(*spellings, dest=key.name, metavar=metavar, default=suppress,
                                help=f"{described} {where}")


def read_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None, config_env: str,
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The flags given (by key name), the values of the ``--config`` file (or the
    file ``config_env`` names) and that file's path: the top two layers but the
    environment."""
    flags = vars(parser.parse_args(list(argv)))
    config_path: str | None = flags.pop("config", None) or (environ or {}).get(config_env) or None
    return flags, load_toml(config_path) if config_path else {}, config_path


def config_defaults(config_class: type) -> dict[str, object]:
    """Every key's default, read off the dataclass's fields (no instance is built:
    a config may require a key, as the sidecar does ``upstream``)."""
    def default(f: dataclasses.Field[Any]) -> object:
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    fields = {f.name: f for f in dataclasses.fields(config_class)}
    wire = default(fields["wire"])
    values: dict[str, object] = {f.name: getattr(wire, f.name) for f in dataclasses.fields(WireConfig)}
    values.update((name, default(f)) for name, f in fields.items() if name != "wire")
    return values


ConfigT = TypeVar("ConfigT")


def build_layered(
    config_class: Callable[..., ConfigT],
    wire_defaults: WireConfig,
    keys: list[ConfigKey],
    *,
    flags: Mapping[str, str | Sequence[str]] | None = None,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_path: str | None = None,
) -> ConfigT:
    """Merge the layers (flag > env > file > default) into a validated ``config_class``:
    the wire keys onto ``wire_defaults``, the others onto the class's defaults.

    ``flags`` maps key names to the text given on the command line; only the
    flags actually given belong in it. Unknown variables are ignored (a newer
    deployment may set keys this version lacks); unknown file keys and flags
    are errors (naming ``file_path``, where the file values came from). A
    repeated flag (a list of texts) reads as the comma list its variable would be."""
    by_name = {key.name: key for key in keys}
    texts = {name: given if isinstance(given, str) else ",".join(given)
             for name, given in (flags or {}).items()}
    values = merge_layers(by_name, from_text=value_from_text, from_toml=value_from_toml, flags=texts,
                          environ=environ, file_values=file_values, file_path=file_path)
    wire_values = {name: value for name, value in values.items() if by_name[name].wire}
    own_values = {name: value for name, value in values.items() if not by_name[name].wire}
    return config_class(wire=wire_defaults.replace(**wire_values), **own_values)
