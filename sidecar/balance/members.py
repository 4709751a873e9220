"""Which upstreams there are: the ``upstream`` entries and the address file.

An entry is one of::

    http://HOST:PORT[/PREFIX] [weight=N]     one engine
    unix:/PATH [weight=N]                    one engine on a Unix socket
    dns+http://NAME:PORT[/PREFIX] [weight=N] every address NAME resolves to, re-resolved
                                             every ``upstream_refresh_s`` (a Kubernetes
                                             headless Service lists its pods this way)
    file:/PATH                               the entries in that file, one a line (``#``
                                             starts a comment), re-read on SIGHUP and when
                                             the file changes

The weight (default 1) is the pod's share of the load under every policy:
round-robin sends it that many turns, least-outstanding and queue-aware divide
its load by it, prefix-affinity gives it that much of the hash space.

Parsing only; resolving names and reading files is the driver's
(``tokenwire.sidecar.upstream.pools``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tokenwire.middleware import ConfigError


class SourceKind(StrEnum):
    STATIC = "static"
    DNS = "dns"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One ``upstream`` entry, parsed."""

    kind: SourceKind
    address: str
    """``http://host:port[/prefix]``, ``unix:/path``, a DNS entry's URL or a file's path."""
    weight: int = 1

    @property
    def dns_name(self) -> str:
        """The name to resolve (``dns`` entries)."""
        return self.address.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")

    def resolved(self, ip: str) -> str:
        """This entry's URL with ``ip`` in place of its name (``dns`` entries)."""
        rest = self.address.split("://", 1)[1]
        hostport, slash, path = rest.partition("/")
        port = hostport.rsplit(":", 1)[1]
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{port}" + (slash + path if slash else "")


def parse_spec(text: str, key: str = "upstream") -> UpstreamSpec:
    """One entry (see the module docstring); :class:`ConfigError` naming ``key`` if malformed."""
    parts = text.split()
    if not parts:
        raise ConfigError(key, "empty upstream entry")
    address, options = parts[0], parts[1:]
    weight = 1
    for option in options:
        name, sep, value = option.partition("=")
        if name != "weight" or not sep or not value.isdigit() or int(value) < 1:
            raise ConfigError(key, f"expected weight=N (N >= 1) after the address, got {option!r}")
        weight = int(value)
    if address.startswith("file:"):
        if options:
            raise ConfigError(key, f"a file: entry takes no weight (give each line its own): {text!r}")
        path = address[len("file:"):]
        if not path:
            raise ConfigError(key, "file: needs a path")
        return UpstreamSpec(SourceKind.FILE, path)
    if address.startswith("dns+http://"):
        url = address[len("dns+"):]
        hostport = url.split("://", 1)[1].split("/", 1)[0]
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(key, f"dns+http:// needs NAME:PORT, got {text!r}")
        return UpstreamSpec(SourceKind.DNS, url, weight)
    if address.startswith("http://"):
        hostport = address[len("http://"):].split("/", 1)[0]
        if not hostport:
            raise ConfigError(key, f"http:// needs HOST:PORT, got {text!r}")
        return UpstreamSpec(SourceKind.STATIC, address.rstrip("/"), weight)
    if address.startswith("unix:") and len(address) > len("unix:"):
        return UpstreamSpec(SourceKind.STATIC, address, weight)
    raise ConfigError(key, "must be http://HOST:PORT, unix:/PATH, dns+http://NAME:PORT or "
                           f"file:/PATH (each but file: with an optional weight=N), got {text!r}")


def parse_address_file(text: str, path: str) -> list[UpstreamSpec]:
    """The entries of an address file: one a line, ``#`` comments, blank lines
    ignored; a ``file:`` line is refused (no file includes another)."""
    specs: list[UpstreamSpec] = []
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        spec = parse_spec(entry, f"{path}:{number}")
        if spec.kind is SourceKind.FILE:
            raise ConfigError(f"{path}:{number}", "an address file cannot name another file")
        specs.append(spec)
    return specs
