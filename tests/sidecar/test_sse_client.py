"""The one response reader of the tools and the tests (tokenwire.tools.sse_client):
what it reports of a response's framing, its events, and a connection that fails."""

from __future__ import annotations

import socket
import threading

from tokenwire.tools.sse_client import (
    END,
    HEAD,
    NEED_DATA,
    BlockingReader,
    ResponseParser,
    parse_response,
    read_response,
)

HEAD_BYTES = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def test_parser_reports_head_then_events_then_end_as_the_bytes_arrive() -> None:
    parser = ResponseParser(keep_raw=True)
    assert parser.next_event() is NEED_DATA
    parser.receive_data(HEAD_BYTES + _chunk(b"id: s.1\ndata: a\n\n: keepalive\n\ndata: b"))
    assert parser.next_event() is HEAD and parser.response.status == 200
    first, comment = parser.next_event(), parser.next_event()
    assert (first.data, first.id, comment.comment) == ("a", "s.1", " keepalive")  # type: ignore[union-attr]
    assert parser.next_event() is NEED_DATA  # "data: b" is not an event until its blank line
    parser.receive_data(_chunk(b"\n\n") + b"0\r\n\r\n")
    assert parser.next_event().data == "b"  # type: ignore[union-attr]
    assert parser.next_event() is END and parser.next_event() is END
    response = parser.current()
    assert response.clean_end and not response.error and response.datas() == ["a", "b"]
    assert response.ids == ["s.1"] and response.raw.startswith(b"HTTP/1.1 200")


def test_parser_when_body_is_cut_before_its_terminator_then_not_clean_and_says_why() -> None:
    response = parse_response(HEAD_BYTES + _chunk(b"data: a\n\n"))
    assert response.datas() == ["a"]
    assert not response.clean_end and "RemoteProtocolError" in response.error


def test_parser_when_responses_are_pipelined_then_the_next_ones_start_is_kept() -> None:
    second = b"HTTP/1.1 204 No Content\r\n\r\n"
    parser = ResponseParser()
    parser.receive_data(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}" + second)
    while parser.next_event() is not END:
        pass
    assert parser.current().json() == {} and parser.trailing == second
    assert parse_response(parser.trailing).status == 204


def test_blocking_reader_when_peer_closes_mid_body_then_unclean() -> None:
    client, server = socket.socketpair()
    with client, server:
        server.sendall(HEAD_BYTES + _chunk(b"data: a\n\n"))

        def close_later() -> None:
            server.shutdown(socket.SHUT_RDWR)

        threading.Timer(0.05, close_later).start()
        response = read_response(client, timeout_s=5)
    assert response.status == 200 and response.datas() == ["a"] and not response.clean_end


def test_blocking_reader_stops_when_asked_and_reads_on_when_called_again() -> None:
    client, server = socket.socketpair()
    with client, server:
        server.sendall(HEAD_BYTES + _chunk(b"data: 1\n\ndata: 2\n\ndata: 3\n\n") + b"0\r\n\r\n")
        reader = BlockingReader(client, timeout_s=5)
        first = reader.read(stop=lambda response, event: len(response.data_events) == 2)
        assert first.stopped and first.datas() == ["1", "2"]
        rest = reader.read()
        assert rest.datas() == ["1", "2", "3"] and rest.clean_end and not rest.stopped
