"""sidecar.ops.httpserver, the small HTTP/1.1 server of the guard and the health endpoints,
driven over real sockets: keep-alive, HEAD, unknown paths and methods, a body over the
limit, ``Expect: 100-continue`` and a header the RFC calls invalid."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sidecar.ops.httpserver import BodyTooLarge, HttpServer, Request, Response

pytestmark = pytest.mark.unit


async def _echo(request: Request) -> Response:
    try:
        body = await request.read(16)
    except BodyTooLarge:
        return Response(413, b'{"error": "too_large"}')
    return Response(200, b'{"got": ' + str(len(body)).encode() + b"}")


async def _hello(_request: Request) -> Response:
    return Response(200, b'{"hello": true}')


def _exchange(port: int, data: bytes, until: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout) as sock:
        sock.sendall(data)
        got = b""
        while until not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


async def _serve(test) -> None:
    server = HttpServer({("POST", "/echo"): _echo, ("GET", "/hello"): _hello})
    _, port = await server.start("127.0.0.1", 0)
    try:
        await asyncio.to_thread(test, port)
    finally:
        await server.stop(1.0)


def run(test) -> None:
    asyncio.run(_serve(test))


def test_two_requests_on_one_kept_alive_connection_are_both_answered():
    def test(port):
        request = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
        got = _exchange(port, request * 2, b'{"hello": true}HTTP/1.1 200')
        assert got.count(b"HTTP/1.1 200") == 2, got
    run(test)


def test_head_answers_the_headers_of_get_without_a_body():
    def test(port):
        got = _exchange(port, b"HEAD /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        b"\r\n\r\n")
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 15" in head, got
        assert body == b""
    run(test)


@pytest.mark.parametrize(("request_line", "status"), [
    (b"GET /nowhere", b"404"), (b"GET /echo", b"405"), (b"DELETE /hello", b"405")])
def test_an_unknown_path_or_method_is_refused(request_line, status):
    def test(port):
        got = _exchange(port, request_line + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"}")
        assert got.startswith(b"HTTP/1.1 " + status), got
    run(test)


def test_a_body_over_the_limit_gets_413_and_the_connection_closes_unread():
    def test(port):
        got = _exchange(port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000"
                        b"\r\n\r\n" + b"x" * 40, b"}")
        assert got.startswith(b"HTTP/1.1 413") and b"connection: close" in got.lower(), got
    run(test)


def test_expect_100_continue_is_answered_when_the_handler_reads_the_body():
    def test(port):
        with socket.create_connection(("127.0.0.1", port), 5) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                         b"Expect: 100-continue\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
            sock.sendall(b"{}")
            final = b""
            while not final.endswith(b"}"):
                chunk = sock.recv(1024)
                if not chunk:
                    break
                final += chunk
        assert final.startswith(b"HTTP/1.1 200") and final.endswith(b'{"got": 2}'), final
    run(test)


def test_a_control_character_in_a_header_value_is_refused_before_any_handler():
    def test(port):
        got = _exchange(port, b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Token: abc\x01\r\n\r\n",
                        b"}")
        assert got.startswith(b"HTTP/1.1 400") and b"hello" not in got, got
    run(test)
