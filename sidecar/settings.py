"""Sidecar configuration: one frozen dataclass, built from four layers.

Precedence, highest first: command-line flag > ``TOKENWIRE_*`` environment
variable > TOML file (``--config``) > built-in default. Every key has the same
spelling in all three sources: ``heartbeat_s`` is ``--heartbeat-s``,
``TOKENWIRE_HEARTBEAT_S`` and ``heartbeat_s = 15.0``. Keys of the wire core
(:class:`~tokenwire.middleware.WireConfig`) and keys of the sidecar itself live
side by side; :class:`SidecarConfig` keeps them apart (``config.wire``).

Unknown TOML keys and bad values are :class:`ConfigError`\\ s naming the key.
Unknown ``TOKENWIRE_*`` variables are ignored, because the engine reads the same
prefix for its own keys and both may share one environment.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenwire.middleware import ConfigError, WireConfig
from tokenwire.middleware.process.config_layers import ConfigKey, build_layered, config_keys
from tokenwire.middleware.process.logs import LOG_LEVELS, LogFormat
from tokenwire.middleware.shared.redis_client import parse_store_url

from .balance.load import PRESETS
from .balance.members import parse_spec
from .balance.policies import POLICIES
from .downstream.cors import normalize_origin
from .downstream.keepalive import PingLimits

ENV_PREFIX = "TOKENWIRE_"

SIDECAR_WIRE_DEFAULTS = WireConfig(retry_attempts=2, upstream_idle_timeout_s=300.0)
"""The wire defaults of a proxy in front of an engine: unlike the middleware,
the sidecar can re-send a request that failed before its first byte, and an
engine that sends no content for 5 minutes after its headers has hung (Envoy's
stream idle timeout). How a complete stream ends is each route's dialect's
(``dialect_routes``: ``[DONE]`` for Chat Completions, ``response.completed``
for Responses, ``message_stop`` for Messages), as in the middleware."""


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything one sidecar process runs with."""

    wire: WireConfig = SIDECAR_WIRE_DEFAULTS
    listen: str = "127.0.0.1:8080"
    """HOST:PORT the proxy listens on (port 0 picks a free one)."""
    upstream: tuple[str, ...] = ()
    """Engines: ``http://host:port``, ``unix:/path``, ``dns+http://name:port`` (every address the
    name resolves to) or ``file:/path`` (a list, re-read on change), each but file: with an
    optional `` weight=N``; spread by ``balance``, a retry goes to another."""
    admin_listen: str = ""
    """HOST:PORT of the admin server (/metrics, /streams, /healthz); empty = off. Beyond
    loopback it needs admin_token (or admin_token_file)."""
    admin_token: str = field(default="", repr=False)
    """Bearer token the admin server asks for (all but /healthz, /readyz and the
    playground page); required when admin_listen is not a loopback address."""
    admin_token_file: str = ""
    """File holding admin_token (read at start; surrounding whitespace ignored)."""
    metrics_public: bool = False
    """Serve /metrics without the admin token (for a scraper on the pod network)."""
    abort_url: str = ""
    """Optional explicit abort call, e.g. ``http://engine/v1/abort/{request_id}``."""
    request_id_header: str = "x-request-id"
    """Request id header: kept if the client sent one, else generated; sent upstream and back."""
    tls_cert: str = ""
    """PEM certificate chain; set (with tls_key) = TLS on the proxy port, reloaded on SIGHUP."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    tls_client_ca: str = ""
    """CA bundle for client certificates; set = mTLS required."""
    drain_s: float = 10.0
    """On SIGTERM, open streams may finish for this long before they are ended."""
    ready_requires_upstream: bool = True
    """/readyz answers 503 while no upstream can take a stream: with health_path, none is in
    by its checks (in from its first passed check); without, the last connect to each failed."""
    ready_requires_store: bool = True
    """/readyz answers 503 while the resume store (resume on, a redis:// store) does not
    answer its PING, sent every health_interval_s."""
    max_connections: int = 10_000
    """Client connections beyond this get 503 with Retry-After."""
    max_head_bytes: int = 64 * 1024
    """Request line + headers larger than this get 431."""
    max_header_count: int = 100
    """Requests with more header lines than this get 400."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Request bodies larger than this get 413 (the sidecar reads them whole)."""
    max_buffered_body_bytes: int = 64 * 1024 * 1024
    """Request bytes held in memory across all connections (bodies are read whole, and
    kept until their answer ends, for retries); a body that would go beyond it gets 503
    with Retry-After."""
    request_usage: bool = True
    """A streamed Chat Completions or Completions request that does not say
    ``stream_options.include_usage`` is sent with it, so the record counts the
    engine's tokens; the usage chunk is not forwarded to that client (off for an
    engine that rejects the field, or one that sends a usage-only chunk unasked,
    which that client would otherwise no longer get)."""
    drop_underscore_headers: bool = True
    """Request headers with ``_`` in their name are not forwarded (nginx's
    ``underscores_in_headers off``): ``X_Real_IP`` and ``X-Real-IP`` may be one header
    to the engine's framework and two to the sidecar."""
    header_read_timeout_s: float = 10.0
    """A request head not complete this long after its first byte gets 408."""
    body_read_timeout_s: float = 60.0
    """A request body not complete this long after its head gets 408."""
    keepalive_timeout_s: float = 60.0
    """An idle keep-alive connection is closed after this long."""
    upstream_connect_timeout_s: float = 5.0
    """Connecting to an upstream longer than this is a connect failure (retried elsewhere)."""
    upstream_max_connections: int = 10_000
    """Connections per upstream pool (one per open stream)."""
    upstream_keepalive_s: float = 4.0
    """Idle pooled upstream connections are closed after this long: below the
    engine's own idle timeout (uvicorn's, so vLLM's and SGLang's, is 5 s), or
    a request can go out on a connection the engine is closing."""
    resume_store: str = "memory"
    """Replay store of resumable streams (``resume = true``): ``memory``, ``redis://HOST:PORT/DB``,
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]`` or
    ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (README: Resume)."""
    log_file: str = "-"
    """Where the stream records go (one line per stream): ``-`` = with the other logs on
    stderr, empty = nowhere, else appended to this file."""
    log_level: str = "info"
    """Lowest level logged: critical, error, warning, info (one line per stream), debug
    (also each stream's lifecycle: accepted, committed, first token, retry, paused, ended)."""
    log_format: LogFormat = LogFormat.JSON
    """Log lines as ``json`` (one object a line) or ``text`` (key=value, for a terminal)."""
    cors_allow_origins: tuple[str, ...] = ()
    """Browser origins (``http://host:port``, or ``*``) that may call the proxy; empty = no CORS."""
    workers: str = "1"
    """Worker processes sharing the proxy port (SO_REUSEPORT), like nginx's worker_processes;
    ``auto`` = the CPUs this process may use. One admin port sees them all."""
    grpc_max_message_bytes: int = 4 * 1024 * 1024
    """gRPC request messages larger than this end the call RESOURCE_EXHAUSTED, nothing
    forwarded (gRPC's own default, 4 MiB)."""
    grpc_keepalive_min_ping_interval_s: float = 300.0
    """HTTP/2 PINGs from a client closer together than this are strikes (gRPC servers' default)."""
    grpc_keepalive_max_ping_strikes: int = 2
    """PING strikes allowed before the connection gets GOAWAY too_many_pings."""
    grpc_keepalive_permit_without_calls: bool = False
    """Accept keepalive PINGs on an HTTP/2 connection with no open stream."""
    balance: str = "least-outstanding"
    """How streams are spread over the upstreams: ``least-outstanding`` (fewest open streams
    from this sidecar, power of two choices), ``round-robin``, ``queue-aware`` (the engines'
    own queue depth from their /metrics) or ``prefix-affinity`` (same prompt start, same pod)."""
    load_poll_s: float = 1.0
    """queue-aware: how often each engine's load_metrics_path is read (each read may take up
    to health_timeout_s; a reading older than 3 polls is not used)."""
    load_metrics: str = "tokenwire"
    """queue-aware: the engine's metric names, a preset: ``tokenwire``, ``vllm``, ``sglang`` or ``tgi``."""
    load_metrics_path: str = "/metrics"
    """queue-aware: the path of the engine's Prometheus metrics."""
    load_metric_waiting: str = ""
    """queue-aware: the waiting-requests metric name(s), comma-separated, first present wins;
    empty = the preset's."""
    load_metric_running: str = ""
    """queue-aware: the running-requests metric name(s); empty = the preset's."""
    load_metric_cache: str = ""
    """queue-aware: the KV-cache use (0..1) metric name(s); empty = the preset's."""
    prefix_affinity_tokens: int = 512
    """prefix-affinity: how much of the prompt's start is hashed, in tokens' worth (4 bytes of
    UTF-8 each; a prompt of token ids is counted exactly)."""
    prefix_affinity_load_factor: float = 2.0
    """prefix-affinity: a pod with this many times its fair share of open streams is passed
    over (least-outstanding picks instead)."""
    prefix_affinity_min_streams: int = 8
    """prefix-affinity: a pod with fewer open streams than this is never passed over (a few
    streams do not load an engine; a spilled prompt evicts another pod's cached prefix)."""
    health_path: str = ""
    """Active health check path (e.g. ``/health``), asked every health_interval_s; empty = off."""
    health_interval_s: float = 2.0
    """Time between two active health checks of a pod."""
    health_timeout_s: float = 1.0
    """A health check not answered 2xx within this long has failed."""
    health_unhealthy_threshold: int = 2
    """Failed checks in a row that take a pod out."""
    health_healthy_threshold: int = 2
    """Passed checks in a row that put it back."""
    outlier_consecutive_failures: int = 5
    """Failures in a row before the first byte (refused, 5xx, no answer) that eject a pod; 0 = never."""
    outlier_base_ejection_s: float = 10.0
    """First ejection time; doubles with each ejection that follows without a success between."""
    outlier_max_ejection_s: float = 300.0
    """The ejection time never grows past this."""
    outlier_max_ejected_share: float = 0.5
    """At most this share of the upstreams (rounded down) is ejected at once."""
    max_streams_per_upstream: int = 0
    """Open streams per upstream from this sidecar; more wait in a FIFO queue (0 = no limit)."""
    queue_max: int = 1000
    """Requests that may wait for a free upstream at once; more get 503 with Retry-After."""
    queue_timeout_s: float = 30.0
    """A request that waited this long for a free upstream gets 503 with Retry-After (in-band
    once its heartbeats have begun)."""
    upstream_refresh_s: float = 5.0
    """How often ``dns+http://`` names are resolved again and ``file:`` lists checked for changes."""

    http2: bool = True
    """Serve HTTP/2 beside HTTP/1.1 on the proxy port: ALPN ``h2`` under TLS, the
    connection preface (prior knowledge) on plaintext."""
    http2_max_concurrent_streams: int = 128
    """Streams one HTTP/2 connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS);
    streams still being answered after a client reset count too."""
    http2_max_header_list_bytes: int = 32 * 1024
    """An HTTP/2 request header list larger than this (decoded) gets 431; one over twice
    this (an HPACK bomb) ends the connection with GOAWAY."""
    http2_header_table_bytes: int = 4096
    """HPACK dynamic table the client's encoder may use (SETTINGS_HEADER_TABLE_SIZE)."""
    http2_stream_window_bytes: int = 1024 * 1024
    """Request body bytes one HTTP/2 stream may send ahead (its receive window)."""
    http2_connection_window_bytes: int = 16 * 1024 * 1024
    """Request body bytes one HTTP/2 connection may send ahead, all streams together."""
    http2_max_streams_per_connection: int = 100_000
    """Streams after which an HTTP/2 connection is asked to go (GOAWAY, NO_ERROR) and
    the client opens a new one (nginx's keepalive_requests)."""
    http2_max_resets_per_s: int = 100
    """Streams an HTTP/2 client may cancel (RST_STREAM) per second; beyond it the
    connection ends with GOAWAY ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487)."""
    http2_max_control_frames_per_s: int = 500
    """SETTINGS, PING and PRIORITY frames an HTTP/2 client may send per second; beyond
    it GOAWAY ENHANCE_YOUR_CALM (CVE-2019-9512, -9515, -9516)."""
    http2_max_empty_frames_per_s: int = 100
    """DATA frames without payload or end an HTTP/2 client may send per second; beyond
    it GOAWAY ENHANCE_YOUR_CALM (CVE-2019-9518)."""
    http2_max_window_updates_per_s: int = 2000
    """WINDOW_UPDATE frames an HTTP/2 client may send per second, its connection's and
    its streams' together; beyond it GOAWAY ENHANCE_YOUR_CALM. A client crediting half a
    64 KiB window at a time reads 32 MB/s of answers per connection under it."""

    def __post_init__(self) -> None:
        for key in ("drain_s", "header_read_timeout_s", "body_read_timeout_s", "keepalive_timeout_s",
                    "upstream_connect_timeout_s", "upstream_keepalive_s",
                    "grpc_keepalive_min_ping_interval_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(key, f"must be a number >= 0, got {value!r}")
        for key in ("max_connections", "max_head_bytes", "max_header_count", "max_body_bytes",
                    "max_buffered_body_bytes", "upstream_max_connections", "grpc_max_message_bytes",
                    "http2_max_concurrent_streams", "http2_max_header_list_bytes",
                    "http2_stream_window_bytes", "http2_connection_window_bytes",
                    "http2_max_streams_per_connection", "http2_max_resets_per_s",
                    "http2_max_control_frames_per_s", "http2_max_empty_frames_per_s",
                    "http2_max_window_updates_per_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(key, f"must be a whole number > 0, got {value!r}")
        parse_host_port(self.listen, "listen")
        if self.admin_token and self.admin_token_file:
            raise ConfigError("admin_token", "give admin_token or admin_token_file, not both")
        if self.admin_listen:
            admin_host, _ = parse_host_port(self.admin_listen, "admin_listen")
            if not is_loopback(admin_host) and not (self.admin_token or self.admin_token_file):
                raise ConfigError(
                    "admin_token", f"the admin server would listen on {self.admin_listen}, beyond "
                    "loopback, where it lists and cancels streams: give it a token (--admin-token-file "
                    "FILE, TOKENWIRE_ADMIN_TOKEN or --admin-token) or listen on 127.0.0.1")
        if not self.upstream:
            raise ConfigError("upstream", "at least one upstream is required (--upstream URL, "
                              "TOKENWIRE_UPSTREAM or upstream in the config file)")
        if not isinstance(self.log_level, str) or self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if isinstance(self.http2_header_table_bytes, bool) or not isinstance(
                self.http2_header_table_bytes, int) or self.http2_header_table_bytes < 0:
            raise ConfigError("http2_header_table_bytes", "must be a whole number >= 0")
        if self.http2_stream_window_bytes > 2**31 - 1 or self.http2_connection_window_bytes > 2**31 - 1:
            raise ConfigError("http2_stream_window_bytes", "HTTP/2 windows are at most 2**31 - 1 bytes")
        for key in ("drop_underscore_headers", "ready_requires_upstream", "ready_requires_store"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, "must be true or false")
        if not isinstance(self.grpc_keepalive_permit_without_calls, bool):
            raise ConfigError("grpc_keepalive_permit_without_calls", "must be true or false")
        strikes = self.grpc_keepalive_max_ping_strikes
        if isinstance(strikes, bool) or not isinstance(strikes, int) or strikes < 0:
            raise ConfigError("grpc_keepalive_max_ping_strikes",
                              f"must be a whole number >= 0, got {strikes!r}")
        if self.resume_store not in ("", "memory"):
            parse_store_url(self.resume_store)  # one server, Sentinel or Cluster, well-formed
        if self.wire.resume and self.resume_store not in ("", "memory") and not self.wire.resume_owner_secret:
            # A random per-process key would make every replica's owner hashes differ:
            # a reconnect landing on another replica would find no stream of its caller.
            raise ConfigError("resume_owner_secret", "a shared resume_store needs the same "
                              "resume_owner_secret on every replica (TOKENWIRE_RESUME_OWNER_SECRET)")
        for entry in self.upstream:
            parse_spec(entry)
        self._check_balance()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert", "tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca", "mTLS needs tls_cert and tls_key")
        if self.abort_url and "{request_id}" not in self.abort_url:
            raise ConfigError("abort_url", "must contain {request_id}")
        if not self.request_id_header or not self.request_id_header.isascii():
            raise ConfigError("request_id_header", "must be a non-empty ASCII header name")
        object.__setattr__(self, "request_id_header", self.request_id_header.lower())
        origins = tuple(normalize_origin(origin) for origin in self.cors_allow_origins)
        for origin in origins:
            scheme, sep, rest = origin.partition("://")
            if origin != "*" and (not sep or scheme not in ("http", "https") or not rest or "/" in rest):
                raise ConfigError("cors_allow_origins", f"must be scheme://host[:port] or *, got {origin!r}")
        object.__setattr__(self, "cors_allow_origins", origins)
        count = self.worker_count
        if count > 1 and self.wire.resume and self.resume_store in ("", "memory"):
            raise ConfigError("workers", f"{count} workers with resume on need a shared replay store: "
                                         "the memory store lives in one worker, and a reconnect may "
                                         "land on another; set --resume-store redis://HOST:PORT/DB "
                                         "or run one worker")
        for key in SHARED_LIMITS:
            limit = getattr(self, key)
            if count > 1 and 0 < limit < count:
                raise ConfigError(key, f"{limit} is fewer than the {count} workers, which share it "
                                       "(each takes a part, at least 1): raise it or run fewer workers")

    def _check_balance(self) -> None:
        if self.balance not in POLICIES:
            raise ConfigError("balance", f"must be one of {', '.join(POLICIES)}, got {self.balance!r}")
        if self.load_metrics not in PRESETS:
            raise ConfigError("load_metrics",
                              f"must be one of {', '.join(PRESETS)}, got {self.load_metrics!r}")
        for key in ("load_poll_s", "prefix_affinity_load_factor", "health_interval_s", "health_timeout_s",
                    "outlier_base_ejection_s", "outlier_max_ejection_s", "queue_timeout_s",
                    "upstream_refresh_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(key, f"must be a number > 0, got {value!r}")
        for key in ("prefix_affinity_tokens", "prefix_affinity_min_streams", "health_unhealthy_threshold",
                    "health_healthy_threshold", "queue_max"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(key, f"must be a whole number > 0, got {value!r}")
        for key in ("outlier_consecutive_failures", "max_streams_per_upstream"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(key, f"must be a whole number >= 0, got {value!r}")
        if not 0 <= self.outlier_max_ejected_share <= 1:
            raise ConfigError("outlier_max_ejected_share", "must be between 0 and 1")
        for key in ("health_path", "load_metrics_path"):
            value = getattr(self, key)
            if value and not value.startswith("/"):
                raise ConfigError(key, f"must be a path starting with /, got {value!r}")

    @property
    def ping_limits(self) -> PingLimits:
        """The gRPC keepalive enforcement of each HTTP/2 connection."""
        return PingLimits(self.grpc_keepalive_min_ping_interval_s, self.grpc_keepalive_max_ping_strikes,
                          self.grpc_keepalive_permit_without_calls)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def worker_count(self) -> int:
        """``workers`` as a number (``auto`` resolved)."""
        text = str(self.workers).strip().lower()
        if text == "auto":
            return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
        if not text.isdigit() or int(text) < 1:
            raise ConfigError("workers", f"must be a whole number >= 1 or auto, got {self.workers!r}")
        return int(text)


SHARED_LIMITS = ("max_streams_per_upstream", "queue_max")
"""Limits that hold for the whole process group under ``--workers N``: each worker
gets its :func:`worker_share`, so N workers never go past them together."""


def worker_share(total: int, workers: int, index: int) -> int:
    """Worker ``index``'s part of a limit of ``total`` (0: none) shared by ``workers``:
    the parts differ by at most one and add up to ``total``."""
    return total // workers + (1 if index < total % workers else 0)


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (a name other than
    ``localhost`` counts as reachable from elsewhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_admin_token(config: SidecarConfig) -> str:
    """The admin token from ``admin_token`` or ``admin_token_file``; empty if neither is set."""
    if not config.admin_token_file:
        return config.admin_token
    try:
        with open(config.admin_token_file, encoding="utf-8") as file:
            token = file.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("admin_token_file", f"cannot read {config.admin_token_file}: {error}") from None
    if not token:
        raise ConfigError("admin_token_file", f"{config.admin_token_file} is empty")
    return token


def parse_host_port(value: str, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 hosts in brackets) as (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(key, f"must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port_text)


def format_host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as :func:`parse_host_port` reads it back: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------- keys


Key = ConfigKey
"""One sidecar configuration key (the shared
:class:`~tokenwire.middleware.process.config_layers.ConfigKey`)."""


def all_keys() -> list[ConfigKey]:
    """Every key: the wire core's first, then the sidecar's."""
    return config_keys(SidecarConfig, ENV_PREFIX)


def build_config(
    flags: Mapping[str, str | Sequence[str]] | None = None,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_path: str | None = None,
) -> SidecarConfig:
    """Merge the layers (flag > env > file > default) into a validated config.

    ``flags`` maps key names to the text given on the command line (a list of
    texts for repeatable keys such as ``upstream``).
    """
    return build_layered(SidecarConfig, SIDECAR_WIRE_DEFAULTS, all_keys(), flags=flags, environ=environ,
                         file_values=file_values, file_path=file_path)
