"""Which pods are in the set: static entries, names resolved, address files read.

The ``upstream`` entries are parsed by :mod:`tokenwire.sidecar.balance.members`
(sans-IO); this module does their I/O. A static entry is a member as it is; a
DNS name is resolved on each :meth:`Membership.refresh` (every
``upstream_refresh_s``, and on SIGHUP), every address it resolves to a member;
an address file is re-read when its modification time or size changed. A name
that does not resolve, or a file that cannot be read, keeps its last members:
serving the last good list beats serving none.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence

from tokenwire.middleware import ConfigError

from ..balance import SourceKind, UpstreamSpec, parse_address_file

logger = logging.getLogger("tokenwire.sidecar")


class Membership:
    """The members of the upstream set and their weights, from the configured entries."""

    def __init__(self, specs: Sequence[UpstreamSpec]) -> None:
        self._specs = list(specs)
        self._file_members: dict[str, dict[str, int]] = {}
        self._file_stamps: dict[str, tuple[float, int] | None] = {}
        self._dns_members: dict[str, dict[str, int]] = {}
        for spec in self._specs:
            if spec.kind is SourceKind.FILE:
                self._read_file(spec.address)

    @property
    def dynamic(self) -> bool:
        """Whether any entry may change (a name or a file), so it needs refreshing."""
        return any(spec.kind is not SourceKind.STATIC for spec in self._specs)

    def members(self) -> dict[str, int]:
        """Every member's address and weight now (the highest of its entries)."""
        members: dict[str, int] = {}
        for spec in self._specs:
            if spec.kind is SourceKind.STATIC:
                found = {spec.address: spec.weight}
            elif spec.kind is SourceKind.DNS:
                found = self._dns_members.get(spec.address, {})
            else:
                found = self._file_members.get(spec.address, {})
            for address, weight in found.items():
                members[address] = max(weight, members.get(address, 0))
        return members

    async def refresh(self) -> bool:
        """Resolve the names and re-read the changed files; True if any member changed."""
        changed = False
        for spec in list(self._specs):
            if spec.kind is SourceKind.FILE:
                changed = self._read_file(spec.address) or changed
            elif spec.kind is SourceKind.DNS:
                changed = await self._resolve(spec) or changed
        return changed

    def forget_file_stamps(self) -> None:
        """Make the next :meth:`refresh` re-read every file, changed or not (SIGHUP)."""
        self._file_stamps.clear()

    def _read_file(self, path: str) -> bool:
        """(Re-)read an address file if it changed; True if its members did."""
        try:
            info = os.stat(path)
            stamp: tuple[float, int] | None = (info.st_mtime, info.st_size)
        except OSError:
            stamp = None
        if path in self._file_stamps and self._file_stamps[path] == stamp:
            return False
        self._file_stamps[path] = stamp
        try:
            with open(path, encoding="utf-8") as file:
                specs = parse_address_file(file.read(), path)
        except (OSError, UnicodeDecodeError, ConfigError) as error:
            logger.error("upstream file %s not read, keeping its last list: %s", path, error)
            return False
        members: dict[str, int] = {}
        for spec in specs:
            if spec.kind is SourceKind.DNS:
                # A name in the file: resolved with the others on each refresh.
                members.update(self._dns_members.get(spec.address, {}))
                if spec not in self._specs:
                    self._specs.append(spec)
            else:
                members[spec.address] = max(spec.weight, members.get(spec.address, 0))
        changed = members != self._file_members.get(path)
        self._file_members[path] = members
        return changed

    async def _resolve(self, spec: UpstreamSpec) -> bool:
        loop = asyncio.get_running_loop()
        port = int(spec.address.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        try:
            infos = await loop.getaddrinfo(spec.dns_name, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            logger.warning("upstream name %s not resolved, keeping its last addresses: %s",
                           spec.dns_name, error)
            return False
        members = {spec.resolved(str(info[4][0])): spec.weight for info in infos}
        changed = members != self._dns_members.get(spec.address)
        self._dns_members[spec.address] = members
        return changed
