"""Engine configuration: one frozen dataclass, built from four layers, passed in.

Precedence, highest first: command-line flag > ``TOKENWIRE_ENGINE_*``
environment variable > TOML file (``--config``, see ``conf/engine.toml``) >
built-in default, as for the sidecar (``tokenwire.sidecar.settings``). Every key
has one spelling in all three sources: ``max_running`` is ``--max-running``,
``TOKENWIRE_ENGINE_MAX_RUNNING`` and ``max_running = 64``.

The environment prefix is ``TOKENWIRE_ENGINE_``, not the sidecar's bare
``TOKENWIRE_``: both processes have a ``listen`` key and may share one
environment (``tokenwire up``, one container running both), and
``TOKENWIRE_LISTEN`` must not move the engine onto the sidecar's port.

The wire core's keys (:class:`~tokenwire.middleware.WireConfig`: heartbeat,
deadlines, pending cap, ...) are keys of the engine too, spelt as for the
sidecar under the engine's prefix (``--heartbeat-s``,
``TOKENWIRE_ENGINE_HEARTBEAT_S``, ``heartbeat_s = 15.0``); they configure the
middleware wrapped around the engine's app and land in ``config.wire``. Two of
them have engine defaults of their own (:func:`engine_wire_defaults`).

Unknown TOML keys and bad values are :class:`~tokenwire.middleware.ConfigError`\\ s
naming the key. This module imports neither torch nor the web stack, so a bad
config file fails fast, before a model is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.middleware import ConfigError, WireConfig
from tokenwire.middleware.process.config_layers import ConfigKey, build_layered, config_keys
from tokenwire.middleware.process.logs import LogFormat

ENV_PREFIX = "TOKENWIRE_ENGINE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
"""The environment variable naming a TOML file, when ``--config`` is not given."""


def engine_wire_defaults() -> WireConfig:
    """The wire core's defaults as the engine needs them, set explicitly.

    No retries: the middleware cannot re-run a request it has already handed
    to the app. Each route's dialect says how its stream ends (``auto``): a
    Chat Completions or Completions stream with ``[DONE]``, a Responses or
    Messages stream with its terminal event, so one that lacks it is reported
    as broken.
    """
    return WireConfig(retry_attempts=0, terminal_marker="auto")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine decides with. Units are in the names."""

    wire: WireConfig = field(default_factory=engine_wire_defaults)
    """The middleware's settings (every :class:`WireConfig` key is an engine key)."""
    model: str = "tiny"
    """``tiny`` (built locally on first use) or a path to a Hugging Face model folder."""
    served_model_name: str | None = None
    """Name reported by ``/v1/models`` and checked against requests; default: derived."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``."""
    dtype: str = "auto"
    """``auto`` (bfloat16 on CUDA, float32 on CPU), ``float32``, ``float16``, ``bfloat16``..."""
    max_running: int = 64
    """Most sequences in the running batch (prefilling ones included)."""
    kv_budget_tokens: int = 262_144
    """Admission budget: sum over admitted requests of prompt + max_tokens."""
    max_prefill_tokens_per_step: int = 96
    """Prompt tokens processed per scheduler step, attention over the cached context counted
    (late chunks of a long prompt get fewer tokens); 0 = whole prompts at once (no chunking).
    96: on a quiet 2-core box, 128 put the decoding streams' p95 gap at 2.0-2.03x a control
    run's (the target is 2x), 96 at 1.87x (``docs/perf/engine.md``)."""
    max_model_len: int | None = None
    """Context cap; default: the model's ``max_position_embeddings``."""
    max_waiting: int = 1024
    """Queued requests beyond this are refused with 503 instead of queued."""
    listen: str = "127.0.0.1:8001"
    """``HOST:PORT`` or ``unix:PATH`` the API listens on."""
    log_level: str = "info"
    """uvicorn and engine log level: critical, error, warning, info, debug, trace."""
    log_format: LogFormat = LogFormat.JSON
    """Log lines as ``json`` (one object a line) or ``text`` (key=value, for a terminal)."""
    threads: int | None = None
    """torch intra-op threads; default: the CPUs this process may use, minus one for the event loop."""
    scheduler_process: bool = True
    """Run the model and the scheduler in a process of their own, so the HTTP side (JSON, the
    middleware, uvicorn) never holds a step up for the GIL and its work overlaps the step on
    another CPU. It applies where this process may use at least two CPUs; on one, the scheduler
    runs in a thread of the server's process whatever this says (two processes would only take
    turns on it). false = always that thread."""
    event_loop: str = "auto"
    """The server's event loop: ``asyncio`` (its socket writes give up the GIL, so with the
    scheduler in a thread they overlap the step's Python), ``uvloop`` (less CPU per write, the
    GIL held throughout), or ``auto``: asyncio with the scheduler thread, uvloop with the
    scheduler process."""

    def __post_init__(self) -> None:
        for name in ("max_running", "kv_budget_tokens", "max_waiting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a whole number >= 1, got {value!r}")
        steps = self.max_prefill_tokens_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError("max_prefill_tokens_per_step", f"must be >= 0 (0 = no chunking), got {steps!r}")
        if self.max_model_len is not None and (
                isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int)
                or self.max_model_len < 2):
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len!r}")
        if self.threads is not None and (
                isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError("threads", f"must be a whole number >= 1 (0 = derived), got {self.threads!r}")
        for name in ("model", "device", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(name, "must be a non-empty string")
        if not isinstance(self.scheduler_process, bool):
            raise ConfigError("scheduler_process", f"must be true or false, got {self.scheduler_process!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError("event_loop",
                              f"must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        check_listen(self.listen)
        if not isinstance(self.log_level, str) or self.log_level.lower() not in _LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")


EVENT_LOOPS = ("auto", "asyncio", "uvloop")
"""Values of ``EngineConfig.event_loop``."""
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def usable_cpus() -> int:
    """The CPUs this process may run on.

    ``sched_getaffinity``, not ``cpu_count``: in a container pinned to two of
    a host's 64 cores, 63 spinning torch threads would fight over two.
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """The CPUs this process may run on, minus one left to the event loop, at least one."""
    return max(1, usable_cpus() - 1)


def runs_scheduler_process(config: EngineConfig) -> bool:
    """Whether the scheduler runs in a process of its own: ``scheduler_process``, where
    this process may use two CPUs or more.

    On a shared 2-core box at 64 streams, the scheduler process stepping on one core while
    the server's loop writes on the other kept a median 0.91 (0.71-1.00 over twelve runs) of
    the scheduler alone's tokens/s, the thread 0.79 (0.74-1.02): in one process the loop
    and the step take turns on the GIL (``docs/perf/engine.md``, "Engine: the scheduler process
    by default")."""
    return config.scheduler_process and usable_cpus() >= 2


def torch_threads(config: EngineConfig) -> int:
    """The intra-op thread count ``config`` asks for (``threads`` or the default)."""
    return config.threads if config.threads is not None else default_threads()


def event_loop(config: EngineConfig) -> str:
    """uvicorn's ``loop`` setting for ``config``: ``event_loop``, ``auto`` resolved.

    With the scheduler in a thread, the socket writes are a third of the loop's
    time per token, and uvloop makes them holding the GIL, so each one stalls the
    step's Python; asyncio's ``socket.send`` releases it and the write overlaps the
    step (on a quiet 2-core box the engine thread waited 2.1 ms per step for the
    GIL instead of 3.4-3.9). The scheduler process shares no GIL with the loop:
    there uvloop's cheaper writes win."""
    if config.event_loop != "auto":
        return config.event_loop
    return "uvloop" if runs_scheduler_process(config) else "asyncio"


def check_listen(value: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is ``HOST:PORT`` or ``unix:PATH``."""
    if value.startswith("unix:"):
        if not value[len("unix:"):]:
            raise ConfigError("listen", "unix:PATH needs a path")
        return
    _host, separator, port = value.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError("listen", f"must be HOST:PORT or unix:PATH, got {value!r}")


# ---------------------------------------------------------------- the layers


EngineKey = ConfigKey
"""One engine configuration key (the shared
:class:`~tokenwire.middleware.process.config_layers.ConfigKey`)."""


def engine_keys() -> list[ConfigKey]:
    """Every key: the wire core's first (as for the sidecar), then the engine's own."""
    return config_keys(EngineConfig, ENV_PREFIX)


def build_engine_config(
    flags: Mapping[str, str | Sequence[str]] | None = None,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_path: str | None = None,
) -> EngineConfig:
    """Merge the layers (flag > env > file > default) into a validated config.

    ``flags`` maps key names to the text given on the command line (a list of
    texts for a repeated flag); only the flags actually given belong in it.
    Unknown ``TOKENWIRE_ENGINE_*`` variables are ignored (a newer deployment
    may set keys this version lacks); unknown file keys and flags are errors.
    """
    return build_layered(EngineConfig, engine_wire_defaults(), engine_keys(), flags=flags,
                         environ=environ, file_values=file_values, file_path=file_path)
