"""An upstream read that is one chunk, framed as the sidecar frames its own
client's chunks, is forwarded as it came (``upstream.body.ChunkDelivery``,
``Exchange.feed_framed_chunk``, ``http1.send_framed``). The client must not
be able to tell: whatever the upstream's size-line spelling and however many
chunks a read holds, each read reaches the client as the chunks the sidecar
frames itself around the core's output. The upstream
sends a read only once the client has what the previous one gave, so every
read is one socket read of the sidecar and the client's bytes are fixed."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from clients import chat_body, connect, request_bytes
from conftest import LoopThread, RunningSidecar
from hypothesis import given, settings
from hypothesis import strategies as st
from upstreams import ScriptedUpstream

StartSidecar = Callable[..., RunningSidecar]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_DONE = b"e\r\ndata: [DONE]\n\n\r\n"
# Text the core forwards as it came (plain events: no "error" or "usage" key, no
# marker), padded so the chunk sizes take one to three hex digits, a-f among them.
_TEXT = st.builds(
    lambda text, pad: text + "p" * pad,
    st.text(alphabet=st.sampled_from(list('abcxyz019 {}":,.-_\u00e9\u4e2d\U0001f600')), max_size=40),
    st.integers(min_value=0, max_value=300),
).filter(lambda text: '"error"' not in text and '"usage"' not in text)


def _spelled(data: bytes, form: str) -> bytes:
    digits = {"lower": f"{len(data):x}", "upper": f"{len(data):X}", "zero": f"0{len(data):x}",
              "extension": f"{len(data):x};a=b"}[form]
    return digits.encode() + b"\r\n" + data + b"\r\n"


def _framed(data: bytes) -> bytes:
    """A chunk as the sidecar frames it for its client."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


class _Paced:
    """The upstream's answer: each read once the client took the last one."""

    def __init__(self, loop_thread: LoopThread, reads: list[bytes]) -> None:
        self.loop_thread = loop_thread
        self.reads = reads
        self.taken: asyncio.Queue[None] | None = None

    async def respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.taken = asyncio.Queue()
        writer.write(_HEAD)
        for read in self.reads:
            await writer.drain()
            writer.write(read)
            await self.taken.get()
        writer.write(_DONE + b"0\r\n\r\n")
        await writer.drain()

    def took_one(self) -> None:
        taken = self.taken
        assert taken is not None
        self.loop_thread.loop.call_soon_threadsafe(taken.put_nowait, None)


def _read_exactly(sock: socket.socket, buffered: bytearray, count: int) -> bytes:
    while len(buffered) < count:
        more = sock.recv(65536)
        assert more, f"the sidecar closed with {bytes(buffered)!r}, {count} bytes expected"
        buffered += more
    out = bytes(buffered[:count])
    del buffered[:count]
    return out


def _stream(sidecar: RunningSidecar, paced: _Paced, expected: list[bytes], *, http10: bool = False) -> None:
    """Request a stream; the client's bytes after the head must be ``expected``, read by read."""
    with connect(sidecar.port) as sock:
        request = request_bytes("POST", "/v1/chat/completions", body=chat_body())
        sock.sendall(request.replace(b"HTTP/1.1", b"HTTP/1.0", 1) if http10 else request)
        buffered = bytearray()
        while b"\r\n\r\n" not in buffered:
            more = sock.recv(65536)
            assert more, bytes(buffered)
            buffered += more
        head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head
        assert (b"transfer-encoding: chunked" in head.lower()) is not http10
        buffered = bytearray(rest)
        for want in expected:
            assert _read_exactly(sock, buffered, len(want)) == want
            paced.took_one()
        end = b"data: [DONE]\n\n" if http10 else _DONE + b"0\r\n\r\n"
        assert _read_exactly(sock, buffered, len(end)) == end


# One upstream read: one or two events, each chunk spelled one way; an event
# with CRLF line ends is rewritten by the core (its parser), the rest pass as they came.
_READ = st.lists(st.tuples(_TEXT, st.sampled_from(["lower", "upper", "zero", "extension"]),
                           st.booleans()), min_size=1, max_size=2)


def test_property_each_read_reaches_the_client_framed_as_the_sidecar_frames_it(
        start_sidecar: StartSidecar, recorder: ScriptedUpstream, loop_thread: LoopThread) -> None:
    sidecar = start_sidecar(recorder.url)

    @settings(max_examples=40, deadline=None)
    @given(reads=st.lists(_READ, min_size=1, max_size=6))
    def check(reads: list[list[tuple[str, str, bool]]]) -> None:
        # The first event commits the response (the core's usual way), alone.
        upstream_reads = [_framed(b'data: {"first":1}\n\n')]
        expected = [_framed(b'data: {"first":1}\n\n')]
        for events in reads:
            upstream_reads.append(b"".join(
                _spelled(f"data: {text}{chr(13) if crlf else ''}\n{chr(13) if crlf else ''}\n".encode(), form)
                for text, form, crlf in events))
            # Events the core forwards as they came go out together, one write
            # a run; one it parses (CRLF line ends) goes out on its own, rewritten.
            out: list[bytes] = []
            run = b""
            for text, _, crlf in events:
                event = f"data: {text}\n\n".encode()
                if crlf:
                    out += [_framed(run)] if run else []
                    out.append(_framed(event))
                    run = b""
                else:
                    run += event
            expected.append(b"".join(out) + (_framed(run) if run else b""))
        paced = _Paced(loop_thread, upstream_reads)
        recorder.respond = paced.respond  # type: ignore[assignment]
        _stream(sidecar, paced, expected)

    check()


def test_an_http10_client_gets_the_events_unframed(
        start_sidecar: StartSidecar, recorder: ScriptedUpstream, loop_thread: LoopThread) -> None:
    # No chunked framing to an HTTP/1.0 client: a read framed as the sidecar
    # would frame it still goes through send_body (h11's close-delimited body).
    sidecar = start_sidecar(recorder.url)
    events = [b'data: {"t":"%d"}\n\n' % i for i in range(5)]
    paced = _Paced(loop_thread, [_framed(event) for event in events])
    recorder.respond = paced.respond  # type: ignore[assignment]
    _stream(sidecar, paced, events, http10=True)
