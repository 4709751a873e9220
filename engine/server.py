"""``tokenwire engine``: load a model and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.trace import TracerProvider
from starlette.types import ASGIApp
from tokenwire.engine.access_log import AccessLog
from tokenwire.engine.cli import build_parser, load_engine_config
from tokenwire.engine.config import (
    EngineConfig,
    engine_wire_defaults,
    event_loop,
    runs_scheduler_process,
    torch_threads,
)
from tokenwire.engine.loading import LoadingServer, bind_unix
from tokenwire.middleware import WireConfig
from tokenwire.middleware.asgi.middleware import listening_socket
from tokenwire.middleware.process.logs import LogFormat, configure_logging
from tokenwire.middleware.process.tracing import tracer_provider_from_env

__all__ = ["GRACEFUL_SHUTDOWN_S", "ListenAddress", "build_asgi_app", "build_parser", "load_engine_config",
           "main"]

GRACEFUL_SHUTDOWN_S = 5
"""After SIGTERM, how long uvicorn lets open requests finish (a pod's grace period counts it)."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """Where to listen: ``host:port`` or ``unix:PATH``."""

    host: str | None = None
    port: int | None = None
    unix_path: str | None = None

    @classmethod
    def parse(cls, text: str) -> ListenAddress:
        """Parse ``HOST:PORT``, ``[V6]:PORT`` or ``unix:PATH``."""
        if text.startswith("unix:"):
            path = text[len("unix:") :]
            if not path:
                raise ValueError("--listen unix:PATH needs a path")
            return cls(unix_path=path)
        host, separator, port = text.rpartition(":")
        if not separator or not port.isdigit():
            raise ValueError(f"--listen {text!r}: expected HOST:PORT or unix:PATH")
        return cls(host=host.strip("[]") or "127.0.0.1", port=int(port))


def build_asgi_app(config: EngineConfig, tracer_provider: TracerProvider | None = None) -> ASGIApp:
    """Load the model (here or in the scheduler process), build the API, wrap it in
    tokenwire's middleware and the access log."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenwire.engine.tiny import ensure_tiny_model

    # transformers writes progress bars and its warnings to stderr itself: as plain
    # lines among the JSON ones. Its records go through our handler instead.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if config.model == "tiny":
        # Its build's progress bar is for a terminal: with JSON logs, a log line
        # per stage instead (``tokenwire up`` relays those).
        text_logs = LogFormat(config.log_format) is LogFormat.TEXT
        say = None if text_logs else logging.getLogger("tokenwire.engine").info
        path: Path = ensure_tiny_model(log=text_logs, say=say)
        name = config.served_model_name or "tiny"
    else:
        path = Path(config.model).expanduser()
        name = config.served_model_name or path.name
    if runs_scheduler_process(config):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a model folder (no config.json)")
        import torch
        from tokenwire.engine.scheduler_process import SchedulerSpec, start_scheduler

        # This process only tokenizes and writes: one torch thread. The scheduler
        # process gets the intra-op threads, one CPU being left to this loop.
        torch.set_num_threads(1)
        starting = start_scheduler(SchedulerSpec(
            model_path=str(path), name=name, device=config.device, dtype=config.dtype,
            threads=torch_threads(config), config=config, log_level=config.log_level))
        # The web stack's imports overlap the child's (torch, transformers, the weights).
        from tokenwire.engine.api import build_app

        launched = starting.wait()
        app = build_app(launched.front_model(), config, launched=launched,
                        tracer_provider=tracer_provider)
        return AccessLog(_wrap_in_middleware(app, config.wire))
    import torch
    from tokenwire.engine.api import build_app
    from tokenwire.engine.loader import load_model

    # Before the first torch op: the pool is sized once. One CPU is left to the
    # event loop, which encodes and writes while the engine thread computes.
    torch.set_num_threads(torch_threads(config))
    loaded = load_model(path, device=config.device, dtype=config.dtype, name=name)
    app = build_app(loaded, config, tracer_provider=tracer_provider)
    return AccessLog(_wrap_in_middleware(app, config.wire))


def _wrap_in_middleware(app: ASGIApp, wire: WireConfig | None = None) -> ASGIApp:
    """``app`` behind tokenwire's middleware; ``wire`` defaults to the engine's wire defaults."""
    from tokenwire.middleware import TokenWireMiddleware

    # No on_abort hook: it is given only the request id, and two requests may
    # send the same X-Request-Id (the second is refused, but if its client left
    # first the hook would abort the first one's row). Each response frees its
    # own row when the middleware cancels it (api.py's _ResponseStream).
    return TokenWireMiddleware(app, config=wire or engine_wire_defaults())


def _listen(listen: ListenAddress, wire: WireConfig) -> socket.socket:
    """The listening socket, bound now: the loading answers use it while the model
    loads (``loading.py``), then uvicorn. TCP: our own (it caps the send buffer of
    accepted connections, so the middleware sees a slow client,
    docs/architecture.md#slow-readers); a Unix socket replaces a stale one, as
    uvicorn would. Raises ``OSError`` naming what is wrong."""
    if listen.unix_path is None:
        assert listen.host is not None and listen.port is not None
        return listening_socket(listen.host, listen.port, wire)
    folder = Path(listen.unix_path).parent
    if not folder.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(folder))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "the directory is not writable", str(folder))
    return bind_unix(listen.unix_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tokenwire engine`` and ``python -m tokenwire.engine.server``."""
    try:
        config = load_engine_config(sys.argv[1:] if argv is None else argv, os.environ)
        listen = ListenAddress.parse(config.listen)
    except ValueError as error:  # ConfigError included: it names the key
        print(f"tokenwire engine: configuration error: {error}", file=sys.stderr)
        return 2
    # uvicorn's "trace" level is below debug; ours stops at debug.
    configure_logging("debug" if config.log_level.lower() == "trace" else config.log_level,
                      config.log_format)
    # Listen before anything loads (torch too, a second and more to import): a
    # busy port or a missing socket directory is one line and exit 2 at once,
    # not a traceback after the model built with a scheduler child left running
    # (a hung process under systemd).
    try:
        sock = _listen(listen, config.wire)
    except OSError as error:
        print(f"tokenwire engine: cannot listen on {config.listen}: {error.strerror or error}"
              + (f" ({error.filename})" if error.filename else ""), file=sys.stderr)
        return 2
    import uvicorn
    from tokenwire.engine.runner import GIL_SWITCH_INTERVAL_S

    # Without a scheduler process, the engine thread gives up the GIL inside
    # every torch op and must take it back after; with the default 5 ms switch
    # interval, an event loop busy encoding chunks could hold it that long each
    # time. 1 ms bounds what the loop can cost a step.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    provider = tracer_provider_from_env(os.environ, "tokenwire-engine")
    # /healthz 200, /readyz 503 on the socket while the model loads (minutes, for
    # a large one): a probe sees an engine that lives and is not ready yet.
    loading = LoadingServer(sock).start()
    try:
        app = build_asgi_app(config, provider)
    except (OSError, ValueError, RuntimeError) as error:  # SchedulerProcessError included
        loading.stop()
        sock.close()
        print(f"tokenwire engine: {error}", file=sys.stderr)
        return 2
    loading.stop()  # connections from now on wait in the backlog for uvicorn
    # log_config=None: uvicorn's loggers go through our handler (configure_logging);
    # its access line lacks the request id, so AccessLog writes that one. A Unix
    # socket goes as its descriptor (uvicorn then names it in its "running on" line).
    unix = listen.unix_path is not None
    uvicorn_config = uvicorn.Config(
        app, fd=sock.fileno() if unix else None, log_level=config.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_config=None, access_log=False,
        loop=event_loop(config),
    )
    server = uvicorn.Server(uvicorn_config)
    # torch, transformers (and in thread mode the model): ~200,000 objects that
    # live as long as the process, out of the collector's sight (a full pass
    # over them held the GIL ~60 ms: the loop and the scheduler thread stalled).
    gc.collect()
    gc.freeze()
    if unix:
        server.run()
    else:
        server.run(sockets=[sock])
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()  # the SDK's: exports the spans still batched
    return 0

if __name__ == "__main__":
    sys.exit(main())
