"""Stream dialects: the rules of each API's event stream, for the wire core.

``base.py`` says what a dialect is (and is the generic one), ``chat.py``,
``responses.py`` and ``anthropic.py`` are the APIs tokenwire knows, and
``routes.py`` picks one per request path. docs/architecture.md has the table.
"""

from .anthropic import AnthropicDialect
from .base import CONTENT, ERROR, FAILED, KEEPALIVE, TERMINAL, Dialect
from .chat import ChatDialect
from .responses import ResponsesDialect
from .routes import DEFAULT_ROUTES, DIALECTS, DialectTable, parse_route

__all__ = ["CONTENT", "DEFAULT_ROUTES", "DIALECTS", "ERROR", "FAILED", "KEEPALIVE", "TERMINAL",
           "AnthropicDialect", "ChatDialect", "Dialect", "DialectTable", "ResponsesDialect", "parse_route"]
