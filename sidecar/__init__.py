"""tokenwire.sidecar: a uvloop/h11 reverse proxy that drives the wire core.

``tokenwire sidecar --listen HOST:PORT --upstream URL`` runs it; in-process,
build a :class:`SidecarConfig` (``build_config``) and ``await Sidecar(config).start()``.
The client side is ``downstream/`` (``http1.py``, ``http2.py``), one proxied
request ``exchange/`` (``loop.py``, the driver loop; ``slot.py``, its attempt),
the engine side ``upstream/`` (``pools.py``, ``attempt.py``), the process
``process/``: each with its theory of operation (docs/architecture.md, "The
modules", lists them all).
"""

from .exchange.forwarding import wants_stream
from .logs import StreamLog
from .process.server import Sidecar, run
from .settings import SidecarConfig, build_config

__all__ = ["Sidecar", "SidecarConfig", "StreamLog", "build_config", "run", "wants_stream"]
