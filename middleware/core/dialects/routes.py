"""Which dialect a stream speaks, by its request's path.

A route is ``PATTERN=DIALECT``: a shell-style pattern (``fnmatch``: ``*``
matches any characters, ``/`` included) matched against the request path
without its query, and one of :data:`DIALECTS`. The first matching route wins;
a path no route matches is ``generic``. The default table matches the ends of
paths, so a prefix in front (``/openai/v1/...``, a gateway's ``/{deployment}``)
changes nothing.

The operator's ``terminal_marker`` applies to the dialects that end with a
marker (Chat Completions, Completions, generic): ``auto`` (the default), Chat
Completions and Completions end with ``[DONE]`` and a generic stream's clean
end is complete; None (empty), a clean end is complete on those routes; any
other value is the marker there. The Responses and Anthropic dialects end
with their own events.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Final

from ..sse import SSEEvent
from .anthropic import AnthropicDialect
from .base import Dialect
from .chat import DONE, ChatDialect
from .responses import ResponsesDialect

DIALECTS: Final = ("chat.completions", "completions", "responses", "anthropic.messages", "generic")
DEFAULT_ROUTES: Final = ("*/chat/completions=chat.completions", "*/completions=completions",
                         "*/responses=responses", "*/messages=anthropic.messages")
AUTO_MARKER: Final = "auto"
"""``terminal_marker``'s default: each dialect's own."""
_CACHE_LIMIT: Final = 1024


def parse_route(entry: str) -> tuple[str, str]:
    """``PATTERN=DIALECT`` as (pattern, dialect); ValueError saying what is wrong."""
    pattern, sep, name = entry.rpartition("=")
    if not sep or not pattern.strip():
        raise ValueError(f"a route is PATTERN=DIALECT, got {entry!r}")
    if name.strip() not in DIALECTS:
        raise ValueError(f"unknown dialect {name.strip()!r} in {entry!r} (one of {', '.join(DIALECTS)})")
    return pattern.strip(), name.strip()


class DialectTable:
    """The routes of one configuration, and the dialect of each path (cached)."""

    def __init__(self, routes: tuple[str, ...] = DEFAULT_ROUTES,
                 terminal_marker: str | None = AUTO_MARKER) -> None:
        """``terminal_marker``: the operator's (see the module docstring)."""
        self.routes = tuple(parse_route(entry) for entry in routes)
        auto = terminal_marker == AUTO_MARKER
        chat_marker = DONE if auto else terminal_marker or None
        generic_marker = None if auto else terminal_marker or None
        self._dialects: dict[str, Dialect] = {
            "chat.completions": ChatDialect(chat_marker, "chat.completions"),
            "completions": ChatDialect(chat_marker, "completions"),
            "responses": ResponsesDialect(),
            "anthropic.messages": AnthropicDialect(),
            "generic": Dialect(generic_marker),
        }
        self._by_path: dict[str, Dialect] = {}

    def named(self, name: str) -> Dialect:
        """The dialect of that name (a KeyError for an unknown one)."""
        return self._dialects[name]

    def for_path(self, path: str) -> Dialect:
        """The dialect of a request path (a query is ignored)."""
        path = path.partition("?")[0]
        found = self._by_path.get(path)
        if found is None:
            name = next((dialect for pattern, dialect in self.routes if fnmatchcase(path, pattern)),
                        "generic")
            found = self._dialects[name]
            if len(self._by_path) >= _CACHE_LIMIT:
                self._by_path.clear()
            self._by_path[path] = found
        return found


def detect(event: SSEEvent, terminal_marker: str | None) -> Dialect:
    """The dialect of a stored stream, from its first event: for a reader who
    resumes it by a path that names none (``GET /v1/streams/{id}``). The shapes
    are told apart as the route's dialects confirm them; an unnamed event of a
    JSON object counts as Chat Completions only with ``choices`` or ``error`` in
    it (or the marker), so a generic stream of JSON stays generic."""
    auto = terminal_marker == AUTO_MARKER
    for dialect in (ResponsesDialect(), AnthropicDialect()):
        if dialect.confirms(event):
            return dialect
    chat = ChatDialect(DONE if auto else terminal_marker or None)
    data = event.data or ""
    if chat.confirms(event) and ('"choices"' in data or '"error"' in data or data == chat.marker):
        return chat
    return Dialect(None if auto else terminal_marker or None)
