"""The client side over HTTP/2: one ``asyncio.Protocol`` per connection, driving h2.

Theory of operation
-------------------
The loop of the sans-IO style: bytes from the socket go to h2
(``receive_data``), each event it returns is handled, and what h2 has to send
(``data_to_send``), with the DATA frames written beside it (http2_data.py), is
written once per loop turn, so the frames of many streams leave in one write.

* ``RequestReceived`` opens an :class:`~tokenwire.sidecar.downstream.http2_stream.Http2Stream`
  after the checks HTTP/1.1 requests get (size, method, target, draining) and
  the connection's own (concurrent streams, streams per connection). A refused
  stream gets its status and JSON error on the stream (431, 413, 503...) or
  RST_STREAM(REFUSED_STREAM); nothing of it reaches an upstream.
* The route (:data:`StreamRoute`) may give a stream to another handler (gRPC);
  otherwise its body is read whole and ``StreamEnded`` starts an
  :class:`~tokenwire.sidecar.exchange.loop.Exchange`, exactly as over HTTP/1.1.
* ``StreamReset`` from the client is ``ClientGone`` for that stream's exchange at
  once (its upstream is aborted); GOAWAY from the client ends all of them so.
* ``WindowUpdated`` and new SETTINGS let held-back bytes go (see http2_stream.py:
  the send windows are the wire core's ``SocketPaused``/``SocketResumed``).
* Floods (resets, SETTINGS/PING/PRIORITY, WINDOW_UPDATE, empty DATA) are
  counted by a :class:`~tokenwire.sidecar.downstream.http2_guard.FloodGuard`,
  frame by frame as a :class:`~tokenwire.sidecar.downstream.http2_frames.FrameGate`
  cuts each read into pieces of a few frames for h2; past a limit nothing more
  of the read is parsed and the connection ends with GOAWAY(ENHANCE_YOUR_CALM).
  h2 itself ends it with a GOAWAY for protocol errors, a CONTINUATION run over
  64 frames and a header block that inflates past twice
  ``http2_max_header_list_bytes`` (HPACK bomb).
* Shutdown sends GOAWAY with the last stream id (written beside h2, whose state
  machine allows nothing after its own GOAWAY); open streams drain, new ones
  are refused, and the connection closes when the last one ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections.abc import Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from ..context import SidecarContext
from .connection import BUSY_BODIES, LINGER_S, Peer, new_exchange, preflight, refusal, set_up_transport
from .http2_data import DataWriter
from .http2_frames import FrameGate
from .http2_guard import Flood, FloodGuard
from .http2_request import RequestHead, request_head, request_problem
from .http2_stream import Http2Stream, StreamHandler
from .keepalive import TOO_MANY_PINGS, PingPolicy

logger = logging.getLogger("tokenwire.sidecar")

StreamRoute = Callable[[RequestHead, Http2Stream], StreamHandler | None]
"""Picks another handler than the exchange for a stream (gRPC by content type),
or None. Called with the request head, before any body arrives."""

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first (RFC 9113 section 3.4)."""

# RFC 7540 section 6.9.2: a fresh stream's send window until SETTINGS say otherwise.
_DEFAULT_WINDOW_BYTES = 65_535
_ErrorCodes = h2.errors.ErrorCodes


class Http2Connection(asyncio.Protocol):
    """One HTTP/2 client connection. See the module docstring."""

    def __init__(self, context: SidecarContext, peer: Peer, *, route: StreamRoute | None = None,
                 over_limit: bool | None = None) -> None:
        """``peer``: what the acceptor learnt of the client (``connection.accepted_peer``).
        ``over_limit``: whether the connection came in past ``max_connections``
        (None: counted when the transport arrives); its streams then get 503."""
        self.context = context
        self._over_limit = over_limit
        self._config = context.config
        self.loop = asyncio.get_running_loop()
        self._route = route
        config = self._config
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True,
            normalize_inbound_headers=True))
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.http2_max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.http2_max_header_list_bytes,
            h2.settings.SettingCodes.HEADER_TABLE_SIZE: config.http2_header_table_bytes,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: config.http2_stream_window_bytes,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        self.data = DataWriter(self.h2)  # what goes out: h2's frames and the answers' DATA frames
        self._transport: asyncio.Transport | None = None
        self._peer = peer
        self.streams: dict[int, Http2Stream] = {}
        """Streams not yet finished, reset ones included until their exchange ends."""
        self.blocked: dict[int, Http2Stream] = {}
        """Streams with bytes held back by a send window, in the order they blocked."""
        self.write_paused = False
        self.closing = False
        self._lost = False
        self._flush_scheduled = False
        self._guard = FloodGuard({
            Flood.RESET: config.http2_max_resets_per_s,
            Flood.CONTROL: config.http2_max_control_frames_per_s,
            Flood.EMPTY: config.http2_max_empty_frames_per_s,
            Flood.WINDOW: config.http2_max_window_updates_per_s,
        }, now=self.loop.time())
        self._gate = FrameGate(self._guard)
        self._pings = PingPolicy(config.ping_limits)  # gRPC keepalive enforcement
        self._streams_opened = 0
        self._goaway_last_id: int | None = None  # set once we sent GOAWAY
        self._idle_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = typing.cast(asyncio.Transport, transport)
        self._transport = transport
        context = self.context
        if self._over_limit is None:
            self._over_limit = len(context.connections) >= self._config.max_connections
        context.connections.add(self)
        self._peer = set_up_transport(context, transport, self._peer)
        h2conn = self.h2
        h2conn.initiate_connection()
        extra = self._config.http2_connection_window_bytes - _DEFAULT_WINDOW_BYTES
        if extra > 0:
            h2conn.increment_flow_control_window(extra)
        self._flush()
        self._arm_idle(self._config.header_read_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        # A few frames at a time, each counted before h2 sees it (http2_frames.py):
        # a flood is cut at the frame past its limit, not after the whole read.
        view, start, now = memoryview(data), 0, self.loop.time()
        while start < len(view) and not self.closing:
            end = self._gate.cut(view, start, now)
            if self._guard.tripped is not None:
                self._calm_down()
                return
            try:
                events = self.h2.receive_data(view[start:end])
            except h2.exceptions.ProtocolError as error:
                # h2 has queued GOAWAY with the error's code; send it and go.
                logger.info("HTTP/2 connection error from %s: %s", self._peer.host, error)
                self._flush()
                self._end_all_streams()
                self._close()
                return
            for event in events:
                if self.closing:
                    break
                self._handle(event)
            start = end
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.closing = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self.context.connections.discard(self)
        self._end_all_streams()

    def pause_writing(self) -> None:
        self.write_paused = True
        for stream in list(self.streams.values()):
            stream.update_paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        for stream in list(self.streams.values()):
            stream.update_paused()

    # ------------------------------------------------------------ events

    def _handle(self, event: h2.events.Event) -> None:
        now = self.loop.time()
        if isinstance(event, h2.events.RequestReceived):
            self._on_request(event)
        elif isinstance(event, h2.events.DataReceived):
            self._on_data(event, now)
        elif isinstance(event, h2.events.StreamEnded):
            self._on_stream_ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.client_gone()
        elif isinstance(event, h2.events.WindowUpdated):
            self._on_window_update(event.stream_id)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self._on_window_update(0)  # a larger INITIAL_WINDOW_SIZE opens every stream
        elif isinstance(event, h2.events.PingReceived):
            # Counted as CONTROL by the gate already; this is gRPC's keepalive policy.
            if self._pings.on_ping(now, open_calls=len(self.streams)):
                self._too_many_pings()
        elif isinstance(event, h2.events.SettingsAcknowledged):
            self._relax_hard_limits()
        elif isinstance(event, h2.events.ConnectionTerminated):
            # The client's GOAWAY: it will read nothing more of ours.
            self._flush()
            self._end_all_streams()
            self._close()

    def _relax_hard_limits(self) -> None:
        """Our SETTINGS are in force, and h2 now enforces them itself by ending
        the connection. Its limits go to twice ours, so a client a little over
        gets what the RFC prefers from us: a stream over the concurrency limit
        RST_STREAM(REFUSED_STREAM), a header list over the size limit 431. Past
        twice (a client ignoring limits, an HPACK bomb) h2 still ends it."""
        config = self._config
        self.h2.decoder.max_header_list_size = 2 * config.http2_max_header_list_bytes
        settings = self.h2.local_settings
        settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 2 * config.http2_max_concurrent_streams
        settings.acknowledge()  # in force at once, not advertised: ours stays the client's limit

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        self._streams_opened += 1
        stream_id = event.stream_id
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._goaway_last_id is not None and stream_id > self._goaway_last_id:
            self._refuse_stream(stream_id)
            return
        # Reset streams still count until their exchange ends (a client that
        # cancels what it opens cannot have more upstream work going), and
        # answered ones until their last frame has left: a client that never
        # opens its window would otherwise have an answer made upstream for
        # every stream it opens, all held here.
        lingering = sum(1 for waiting in self.blocked.values() if waiting.finished)
        if len(self.streams) + lingering >= self._config.http2_max_concurrent_streams:
            self._refuse_stream(stream_id)
            return
        head = request_head(stream_id, event.headers or [])
        stream = Http2Stream(self, head)
        self.streams[stream_id] = stream
        self._fit_write_limits()
        if self._streams_opened >= self._config.http2_max_streams_per_connection:
            self._send_goaway(stream_id, _ErrorCodes.NO_ERROR)
        problem: tuple[int, str] | None = (
            (503, "the server is not taking new requests") if self.context.draining or self._over_limit
            else request_problem(head, event.headers or [], self._config))
        if problem is not None:
            status, message = problem
            self._refuse(stream, status, message, 1 if status == 503 else None)
            return
        if self._route is not None:
            stream.handler = self._route(head, stream)
            if stream.handler is not None:
                return
        length = head.header(b"content-length")
        if length is not None and length.isdigit() and not stream.reservation.reserve(int(length)):
            self._refuse(stream, 503, BUSY_BODIES, 1)
            return
        stream.set_timer(self._config.body_read_timeout_s,
                         lambda: self._refuse(stream, 408, "the request was not received in time"))

    def _on_data(self, event: h2.events.DataReceived, now: float) -> None:
        stream_id = event.stream_id
        data = event.data or b""
        if event.flow_controlled_length:
            # Credited at once: bodies are read whole anyway, bounded by
            # max_body_bytes and max_buffered_body_bytes, and a window held shut
            # would let one stream's upload starve the connection's others.
            self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
        # An empty DATA frame the gate could not count: padding was all it held.
        if (not data and event.stream_ended is None and event.flow_controlled_length
                and self._guard.count(Flood.EMPTY, now)):
            self._calm_down()
            return
        stream = self.streams.get(stream_id)
        if stream is None or stream.closed:
            return
        if stream.handler is not None:
            stream.handler.data_received(data)
            return
        if stream.exchange is not None:
            return
        max_body = self._config.max_body_bytes
        if len(stream.body) + len(data) > max_body:
            self._refuse(stream, 413, f"request body over {max_body} bytes")
            return
        if stream.head.header(b"content-length") is None and not stream.reservation.reserve(len(data)):
            self._refuse(stream, 503, BUSY_BODIES, 1)
            return
        stream.body += data

    def _on_stream_ended(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is None or stream.closed:
            return
        stream.request_complete = True
        if stream.handler is not None:
            stream.handler.request_ended()
            return
        head = stream.head
        headers = list(head.headers)
        if head.authority is not None and head.header(b"host") is None:
            headers.insert(0, (b"host", head.authority))
        answer = preflight(self.context, head.method, headers)
        if answer is not None:
            status, answer_headers, body = answer
            stream.respond_head(status, answer_headers)
            stream.send_body(body)
            stream.end_response(abrupt=False, reset=False)
            stream.exchange_finished(None)
            return
        body = bytes(stream.body)
        stream.body = bytearray()
        exchange = new_exchange(self.context, stream, method=head.method, target=head.path,
                                headers=headers, body=body, peer=self._peer, http_version="2")
        stream.exchange = exchange
        stream.cancel_timer()  # the body read timer
        exchange.start()
        stream.update_paused()

    def _on_window_update(self, stream_id: int) -> None:
        if stream_id:
            stream = self.blocked.get(stream_id)
            if stream is not None:
                stream.push()
            return
        for stream in list(self.blocked.values()):
            if not stream.push() and self.h2.outbound_flow_control_window <= 0:
                break

    # ------------------------------------------------------------ the streams' calls

    @property
    def peer(self) -> Peer:
        """What the socket says about the client (for a handler's forwarded request)."""
        return self._peer

    def stream_finished(self, stream: Http2Stream) -> None:
        """A stream's answer is over: forget it; close if draining and it was the last."""
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
            self._fit_write_limits()
        # Its last bytes may still wait for a window (it stays in self.blocked).
        if self.closing:
            return
        if not self.streams:
            if self._goaway_last_id is not None:
                self._flush()
                self._close()
            else:
                self._arm_idle(self._config.keepalive_timeout_s)

    def schedule_flush(self) -> None:
        """Write what h2 holds at the end of this loop turn (one write for many streams)."""
        self._pings.on_sent()  # a stream sent something: the connection is in use
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    # ------------------------------------------------------------ shutdown

    @property
    def idle(self) -> bool:
        """No stream open: safe to close on shutdown."""
        return not self.streams

    def close_if_idle(self) -> None:
        """Shutdown: GOAWAY (once) so no new stream starts; close once no stream is open."""
        if self.closing:
            return
        if self._goaway_last_id is None:
            self._send_goaway(self.h2.highest_inbound_stream_id, _ErrorCodes.NO_ERROR)
        if not self.streams:
            self._close()

    def abort(self) -> None:
        """Drop the connection at once (shutdown's last resort)."""
        if self._transport is not None:
            self._transport.abort()

    # ------------------------------------------------------------ helpers

    def _fit_write_limits(self) -> None:
        """The socket's write high-water mark, ``write_high_water_bytes`` per
        open stream. Sized for one stream, as an HTTP/1.1 connection's is, it
        paused the socket at the first burst of a busy connection, and a
        paused socket pauses every stream on it (each core then takes the
        slower paused path). Per stream, the socket pauses when the client
        reads less than the streams bring, as one HTTP/1.1 connection per
        stream would; a stream whose own window is shut waits in its own
        buffer and pauses alone (http2_stream.py)."""
        transport = self._transport
        if transport is not None and not self._lost:
            transport.set_write_buffer_limits(
                high=self._config.wire.write_high_water_bytes * max(1, len(self.streams)))

    def _refuse(self, stream: Http2Stream, status: int, message: str,
                retry_after_s: int | None = None) -> None:
        """Answer one stream with an error status; nothing of it is forwarded."""
        if stream.closed or stream.exchange is not None:
            return
        stream.reservation.release()
        headers, body = refusal(self.context, status, message, retry_after_s=retry_after_s)
        stream.respond_head(status, headers)
        stream.send_body(body)
        stream.end_response(abrupt=False, reset=False)
        stream.exchange_finished(None)
        self._flush()

    def _refuse_stream(self, stream_id: int) -> None:
        """RST_STREAM(REFUSED_STREAM): the client may retry it elsewhere, nothing was done."""
        self.context.metrics.rejected_requests.labels("refused_stream").inc()
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.h2.reset_stream(stream_id, _ErrorCodes.REFUSED_STREAM)

    def _calm_down(self) -> None:
        """A flood: GOAWAY(ENHANCE_YOUR_CALM), every stream ended, the connection closed."""
        if self.closing:
            return
        kind = self._guard.tripped
        logger.warning("HTTP/2 %s flood from %s: closing the connection", kind.value if kind else "frame",
                       self._peer.host)
        self.context.metrics.rejected_requests.labels("h2_flood").inc()
        self.h2.close_connection(_ErrorCodes.ENHANCE_YOUR_CALM)
        self._flush()
        self._end_all_streams()
        self._close()

    def _too_many_pings(self) -> None:
        """Keepalive PINGs past the policy: GOAWAY(ENHANCE_YOUR_CALM, ``too_many_pings``),
        on which gRPC clients back off their keepalive, and the connection closed."""
        if self.closing:
            return
        logger.info("HTTP/2 client %s sent too many PINGs: closing the connection", self._peer.host)
        self.context.metrics.rejected_requests.labels("too_many_pings").inc()
        self.h2.close_connection(_ErrorCodes.ENHANCE_YOUR_CALM, additional_data=TOO_MANY_PINGS)
        self._flush()
        self._end_all_streams()
        self._close()

    def _send_goaway(self, last_stream_id: int, code: h2.errors.ErrorCodes) -> None:
        """GOAWAY that lets streams up to ``last_stream_id`` finish (beside h2, see the module docstring)."""
        if self._goaway_last_id is not None or self._transport is None or self._lost:
            return
        self._goaway_last_id = last_stream_id
        self._flush()
        frame = GoAwayFrame(0)
        frame.last_stream_id = last_stream_id
        frame.error_code = code
        self._transport.write(frame.serialize())

    def _end_all_streams(self) -> None:
        for stream in list(self.streams.values()):
            stream.client_gone()

    def _flush(self) -> None:
        self._flush_scheduled = False
        data = self.data.take()
        if data and self._transport is not None and not self._lost:
            self._transport.write(data)

    def _close(self) -> None:
        """Close after what is written; a lingering close where the socket can
        half-close: a client still sending (a flood) would otherwise get a reset
        that discards our GOAWAY before it reads it."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.closing = True
        transport = self._transport
        if transport is None or self._lost:
            return
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.abort)
        else:
            transport.close()
            # A client that stopped reading would hold the flush forever.
            self.loop.call_later(self._config.wire.close_flush_timeout_s, transport.abort)

    def _arm_idle(self, delay_s: float) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(delay_s, self._on_idle)

    def _on_idle(self) -> None:
        self._idle_timer = None
        if not self.streams and not self.closing:
            self._send_goaway(self.h2.highest_inbound_stream_id, _ErrorCodes.NO_ERROR)
            self._close()
