"""``tokenwire engine``: load a model and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp
from tokenwire.engine.config import EngineConfig
from tokenwire.middleware import WireConfig
from tokenwire.middleware.asgi import listening_socket


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


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenwire engine`` command line."""
    defaults = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="tokenwire engine",
        description="Serve a causal LM over an OpenAI-compatible API with continuous batching.",
    )
    parser.add_argument("--listen", default="127.0.0.1:8001",
                        help="HOST:PORT or unix:PATH (default: %(default)s)")
    parser.add_argument("--model", default=defaults.model,
                        help="'tiny' (built locally on first use) or a Hugging Face model folder")
    parser.add_argument("--served-model-name", default=None,
                        help="name in /v1/models and requests (default: tiny or the folder name)")
    parser.add_argument("--device", default=defaults.device,
                        help="auto, cpu or cuda[:N] (default: %(default)s)")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto, float32, float16, bfloat16 (default: %(default)s)")
    parser.add_argument("--max-running", type=int, default=defaults.max_running,
                        help="most sequences in the batch (default: %(default)s)")
    parser.add_argument("--kv-budget-tokens", type=int, default=defaults.kv_budget_tokens,
                        help="admission budget, prompt + max_tokens summed (default: %(default)s)")
    parser.add_argument("--max-prefill-tokens-per-step", type=int,
                        default=defaults.max_prefill_tokens_per_step,
                        help="prompt tokens per step; 0 disables chunking (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cap the context length (default: the model's)")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="queued requests beyond this get a 503 (default: %(default)s)")
    parser.add_argument("--log-level", default="info", help="uvicorn and engine log level")
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The frozen config the flags describe."""
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        max_running=args.max_running,
        kv_budget_tokens=args.kv_budget_tokens,
        max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
    )


def build_asgi_app(config: EngineConfig) -> ASGIApp:
    """Load the model, build the API, wrap it in tokenwire's middleware."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenwire.engine.api import build_app
    from tokenwire.engine.loader import load_model
    from tokenwire.engine.tiny import ensure_tiny_model

    if config.model == "tiny":
        path: Path = ensure_tiny_model()
        name = config.served_model_name or "tiny"
    else:
        path = Path(config.model).expanduser()
        name = config.served_model_name or path.name
    loaded = load_model(path, device=config.device, dtype=config.dtype, name=name)
    app = build_app(loaded, config)
    return _wrap_in_middleware(app)


def _wrap_in_middleware(app: ASGIApp) -> ASGIApp:
    from tokenwire.middleware import TokenWireMiddleware

    engine = app.state.engine  # type: ignore[attr-defined]
    return TokenWireMiddleware(app, config=wire_config(), on_abort=engine.service.abort)


def wire_config() -> WireConfig:
    """The middleware config for the engine.

    No retries (the middleware cannot re-run a request it has handed to the
    app), and ``[DONE]`` as the terminal marker: every complete engine stream
    ends with it, so one that lacks it is reported as broken.
    """
    return WireConfig(retry_attempts=0, terminal_marker="[DONE]")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tokenwire engine`` and ``python -m tokenwire.engine.server``."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        config = config_from_args(args)
        listen = ListenAddress.parse(args.listen)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    import uvicorn

    try:
        app = build_asgi_app(config)
    except (OSError, ValueError) as error:
        print(f"tokenwire engine: {error}", file=sys.stderr)
        return 2
    uvicorn_config = uvicorn.Config(
        app, uds=listen.unix_path, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(uvicorn_config)
    if listen.unix_path is not None:
        server.run()
    else:
        # Our own listening socket: it caps the send buffer of accepted
        # connections, so the middleware sees a slow client (DESIGN.md).
        assert listen.host is not None and listen.port is not None
        sock = listening_socket(listen.host, listen.port, wire_config())
        server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
