"""tokenwire.sidecar: a uvloop/h11 reverse proxy that drives the wire core.

``tokenwire sidecar --listen HOST:PORT --upstream URL`` runs it; in-process,
build a :class:`SidecarConfig` (``build_config``) and ``await Sidecar(config).start()``.
See ``protocol.py`` (client side), ``exchange.py`` (the driver loop) and
``upstream.py`` (engine side) for the theory of operation.
"""

from .exchange.forwarding import wants_stream
from .logs import StreamLog
from .process.server import Sidecar, run
from .settings import SidecarConfig, build_config

__all__ = ["Sidecar", "SidecarConfig", "StreamLog", "build_config", "run", "wants_stream"]
