"""The load test's HTTP client (stdengine.bench.http_stream) against a loopback server that writes
its replies byte by byte as each test scripts them: every framing the client claims to read, a
stalled server, a refused connection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from stdengine.bench.http_stream import LeanClient

Handler = Callable[[dict, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> dict | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    line, *fields = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
    body = await reader.readexactly(int(headers["content-length"]))
    return {"line": line, "headers": headers, "json": json.loads(body)}


async def _serve(handler: Handler) -> tuple[asyncio.Server, list[dict], list[int]]:
    """A server on a free port; the requests it got, and how many connections it accepted."""
    requests: list[dict] = []
    connections = [0]

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        if (req := await _read_request(reader)) is not None:
            requests.append(req)
            await handler(req, writer)
        writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    return server, requests, connections


def _url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def _post(client: LeanClient, body: dict) -> tuple[int, str]:
    async with client.post("/completions", body) as r:
        return r.status, "".join([t async for t in r.text()])


def test_chunked_reply_is_joined_whatever_the_cuts():
    # "é" is two bytes, cut between two chunks; the request carries the base path, Host and headers
    async def handler(req: dict, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(_chunked(b"data: caf\xc3", b"\xa9\n", b"\ndata: [DONE]\n\n"))
        await w.drain()

    async def main() -> None:
        server, requests, _ = await _serve(handler)
        port = server.sockets[0].getsockname()[1]
        async with server:
            client = LeanClient(_url(server), {"Authorization": "Bearer k"})
            assert await _post(client, {"n": 1}) == (200, "data: café\n\ndata: [DONE]\n\n")
        (req,) = requests
        assert req["line"] == "POST /v1/completions HTTP/1.1" and req["json"] == {"n": 1}
        assert req["headers"]["authorization"] == "Bearer k"
        assert req["headers"]["host"] == f"127.0.0.1:{port}" and req["headers"]["connection"] == "close"

    asyncio.run(main())


def test_content_length_and_close_delimited_replies():
    replies = [
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n" + b'{"error":"x"}',
        b"HTTP/1.0 200 OK\r\n\r\nthe end is the close",  # no length: the body ends with the connection
    ]

    async def handler(req: dict, w: asyncio.StreamWriter) -> None:
        w.write(replies[req["json"]["i"]])
        await w.drain()

    async def main() -> None:
        server, _, connections = await _serve(handler)
        async with server:
            client = LeanClient(_url(server), {})
            async with client.post("/completions", {"i": 0}) as r:
                assert r.status == 400 and await r.read() == b'{"error":"x"}'
            assert await _post(client, {"i": 1}) == (200, "the end is the close")
        assert connections[0] == 2  # one a request

    asyncio.run(main())


def test_a_server_that_stops_sending_times_out():
    async def handler(req: dict, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"5\r\nhello\r\n")
        await w.drain()
        await asyncio.sleep(5)  # then nothing

    async def main() -> None:
        server, _, _ = await _serve(handler)
        async with server:
            client = LeanClient(_url(server), {}, timeout=0.3)
            got = []
            with pytest.raises(TimeoutError, match="sent nothing for 0.3 s"):
                async with client.post("/completions", {}) as r:
                    async for text in r.text():
                        got.append(text)
            assert got == ["hello"]

    asyncio.run(main())


def test_a_refused_connection_and_a_non_http_url_are_errors():
    async def main() -> None:
        server, _, _ = await _serve(lambda req, w: asyncio.sleep(0))
        url = _url(server)
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await _post(LeanClient(url, {}), {})

    asyncio.run(main())
    with pytest.raises(ValueError, match="not an http"):
        LeanClient("ftp://example.com/v1", {})
