"""The load test's HTTP client: POSTs a JSON body and reads the streamed reply as it arrives, over
asyncio streams, one connection per request.

Why not httpx, which the rest of infer-bench uses: the load test runs on the machine it measures,
and there every millisecond of the client's is taken from the server (on 2 cores, from one of its
compute threads, which the other then waits for at a barrier). httpx's asyncio stack (httpcore,
anyio, h11) spent about 0.5 ms of CPU per streamed chunk at concurrency 1 and 0.14 ms at 8; this
client spends about a quarter of that (README, "The load test's own cost"). It speaks only what the
load test needs: http and https, no proxy, replies framed by chunked encoding, Content-Length or the
connection's close. Each request has its own connection (the load test stops reading a stream at its
[DONE], which leaves nothing to reuse; so did httpx, which closes a reply not read to its end).
"""

from __future__ import annotations

import asyncio
import codecs
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit


class Reply:
    """A reply's status and headers, then its body as it arrives (once: chunks(), text() or
    read())."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self.status = 0
        self.headers: dict[str, str] = {}
        self.reads = 0  # of the body so far (a stalled server shows as a count that stays)

    async def _read_head(self) -> None:
        head = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/") or not rest[:3].isdigit():
            raise ConnectionError(f"not an HTTP reply: {status_line[:80]!r}")
        self.status = int(rest[:3])
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, as the server sent them."""
        r = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await r.readuntil(b"\r\n")).split(b";")[0], 16):
                data = await r.readexactly(size + 2)  # and the CR LF that ends the chunk
                self.reads += 1
                yield data[:-2]
            while await r.readuntil(b"\r\n") != b"\r\n":  # trailers, if any, up to the blank line
                pass
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await r.read(min(left, 1 << 16))
                if not data:
                    raise asyncio.IncompleteReadError(b"", left)
                left -= len(data)
                self.reads += 1
                yield data
        else:  # the body ends where the connection does
            while data := await r.read(1 << 16):
                self.reads += 1
                yield data

    async def text(self) -> AsyncIterator[str]:
        """The body as text (UTF-8; a character split across chunks is joined)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for data in self.chunks():
            if text := decoder.decode(data):
                yield text
        if tail := decoder.decode(b"", final=True):
            yield tail

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])


class LeanClient:
    """POSTs to paths under base_url (http:// or https://), each with headers. A request fails (an
    exception) when connecting takes more than connect_timeout seconds or the server sends nothing
    for timeout seconds."""

    def __init__(
        self, base_url: str, headers: dict[str, str], connect_timeout: float = 10.0, timeout: float = 600.0
    ) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url}")
        self._host = u.hostname
        self._port = u.port or (443 if u.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        self._base = u.path.rstrip("/")
        host = u.netloc.rpartition("@")[2]  # as the URL gives it: [::1]:8080, example.com
        fields = {"Host": host, **headers, "Content-Type": "application/json", "Connection": "close"}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        self._connect_timeout = connect_timeout
        self._timeout = timeout

    @asynccontextmanager
    async def post(self, path: str, body: Any) -> AsyncIterator[Reply]:
        data = json.dumps(body).encode()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self._host, self._port, ssl=self._ssl), self._connect_timeout
        )
        reply = Reply(reader)
        watchdog = _Watchdog(reply, writer, self._timeout)
        try:
            writer.write(
                f"POST {self._base}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await reply._read_head()
            yield reply
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if watchdog.fired:
                raise TimeoutError(f"the server sent nothing for {self._timeout:g} s") from e
            raise
        finally:
            watchdog.cancel()
            writer.close()


class _Watchdog:
    """Aborts a reply's connection once it has received nothing for timeout seconds. One timer per
    request, moved on only when it fires (a timer per read would cost the client what it is here
    to save)."""

    def __init__(self, reply: Reply, writer: asyncio.StreamWriter, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reply, self._writer, self._timeout = reply, writer, timeout
        self._seen = reply.reads
        self.fired = False
        self._timer = self._loop.call_later(timeout, self._check)

    def _check(self) -> None:
        if self._reply.reads == self._seen:
            self.fired = True
            self._writer.transport.abort()
            return
        self._seen = self._reply.reads
        self._timer = self._loop.call_later(self._timeout, self._check)

    def cancel(self) -> None:
        self._timer.cancel()
