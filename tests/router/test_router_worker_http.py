"""The router's worker-leg client (pdserve/http/client.py): the SSE decoder on
every split of a stream, and the client over real HTTP (a raw asyncio server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.http.client import TRANSPORT_ERRORS, SSEDecoder, WorkerClient
from pdserve.http.netutil import free_port

STREAM = (
    b"\xef\xbb\xbf: a comment\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: named\rdata:no space\rdata:  two spaces\r\r"
    b"id: 7\nretry: 10\nunknown: x\ndata\n\n"
    b"event: no data, not dispatched\n\n"
    b"data: caf\xc3\xa9 \xff\n\n"
    b"data: [DONE]\n\n"
    b"data: unfinished at EOF"
)
EXPECTED = [
    ('{"a": 1}', "", ""),
    ("no space\n two spaces", "named", ""),
    ("", "", "7"),
    ("café \ufffd", "", "7"),
    ("[DONE]", "", "7"),
]


def _decode(chunks: list[bytes]) -> list[tuple[str, str, str]]:
    decoder = SSEDecoder()
    return [(e.data, e.event, e.id) for c in chunks for e in decoder.feed(c)]


def test_sse_decoder_whole_stream():
    assert _decode([STREAM]) == EXPECTED


def test_sse_decoder_every_split_and_bytewise():
    """Any cut of the bytes (inside a CRLF, the BOM, a UTF-8 character) decodes alike."""
    for cut in range(len(STREAM) + 1):
        assert _decode([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut
    assert _decode([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_sse_decoder_crlf_split_counts_once():
    # "data: x\r" + "\n" + "\r\n": one CRLF line end, then a blank line: one event
    assert _decode([b"data: x\r", b"\n", b"\r\n"]) == [("x", "", "")]
    # a CR then a CR: a blank line, the event ends there
    assert _decode([b"data: y\r", b"\r"]) == [("y", "", "")]


async def _server(handler) -> tuple[asyncio.AbstractServer, int]:
    port = free_port("127.0.0.1")
    return await asyncio.start_server(handler, "127.0.0.1", port), port


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def test_client_post_stream_and_errors():
    """A POST's body goes as JSON with the given headers, over one kept-alive
    connection; a stream's events come as they are sent; closing a stream before its end
    closes the connection (the worker sees the client leave); a refused connection
    raises a TRANSPORT_ERRORS member."""

    async def scenario() -> None:
        connections, seen, gone = [], [], asyncio.Event()

        async def handler(reader, writer):
            connections.append(writer)
            try:
                while True:
                    head, body = await _read_request(reader)
                    seen.append((head.split(b" ")[1], json.loads(body), head.lower()))
                    if head.startswith(b"POST /stream"):
                        writer.write(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"transfer-encoding: chunked\r\n\r\n"
                        )
                        for piece in (b'data: {"n": 1}\n', b"\ndata: [DO", b"NE]\n\n"):
                            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                            await writer.drain()
                            await asyncio.sleep(0.01)
                        await reader.read()  # the client closes before the last chunk
                        gone.set()
                        return
                    answer = json.dumps({"ok": True}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )
            except asyncio.IncompleteReadError:
                pass
            finally:
                writer.close()

        server, port = await _server(handler)
        client = WorkerClient(connect_timeout=5.0)
        try:
            url = f"http://127.0.0.1:{port}"
            for i in range(3):
                resp = await client.post(f"{url}/v1/completions", {"i": i, "t": "é"}, {"x-a": "b"})
                assert resp.status_code == 200 and resp.json() == {"ok": True}
            assert len(connections) == 1  # kept alive
            assert [s[1] for s in seen] == [{"i": i, "t": "é"} for i in range(3)]
            assert b"x-a: b" in seen[0][2] and b"content-type: application/json" in seen[0][2]

            stream = await client.open(f"{url}/stream", {"stream": True}, {})
            assert stream.status_code == 200
            events = []
            async for event in stream.aiter_sse():
                events.append(event.data)
                if event.data == "[DONE]":
                    break
            assert events == ['{"n": 1}', "[DONE]"]
            await stream.aclose()  # the last chunk (0-length) never came: connection closed
            await asyncio.wait_for(gone.wait(), 5)

            dead = free_port("127.0.0.1")
            with pytest.raises(TRANSPORT_ERRORS):
                await client.post(f"http://127.0.0.1:{dead}/x", {}, {})
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_closed_transport_at_write_is_a_connection_error_and_a_pooled_one_is_retried():
    """uvloop raises RuntimeError when a request is written on a transport it has closed
    (a worker killed between its answers): a pooled connection is then replaced by a fresh
    one and the request sent again; a fresh one raises a TRANSPORT_ERRORS member, so that
    the dispatcher fails the leg (ejection, migration), not the router (500)."""

    async def scenario() -> None:
        async def handler(reader, writer):
            try:
                while True:
                    await _read_request(reader)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            except asyncio.IncompleteReadError:
                writer.close()

        def closed(data: bytes) -> None:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

        server, port = await _server(handler)
        client = WorkerClient()
        url = f"http://127.0.0.1:{port}/x"
        try:
            assert (await client.post(url, {}, {})).status_code == 200
            (pooled,) = client._idle[("127.0.0.1", port)]
            pooled.transport.write = closed  # closed under the pool, not yet seen as closing
            assert (await client.post(url, {}, {})).status_code == 200  # on a new connection
            assert pooled.closed
            real_connect = client._connect

            async def connect_closed(address):
                conn = await real_connect(address)
                conn.transport.write = closed
                return conn

            client._idle.clear()
            client._connect = connect_closed
            with pytest.raises(TRANSPORT_ERRORS, match="closed before the request"):
                await client.post(url, {}, {})
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_stream_broken_midway_raises():
    """A connection lost in the middle of a chunked stream raises from aiter_sse."""

    async def scenario() -> None:
        async def handler(reader, writer):
            await _read_request(reader)
            writer.write(
                b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\ndata: {"n": 1}\n\n\r\n'
            )
            await writer.drain()
            writer.transport.abort()

        server, port = await _server(handler)
        client = WorkerClient()
        try:
            stream = await client.open(f"http://127.0.0.1:{port}/s", {}, {})
            got = []
            with pytest.raises(TRANSPORT_ERRORS):
                async for event in stream.aiter_sse():
                    got.append(event.data)
            assert got == ['{"n": 1}']
            await stream.aclose()
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())
