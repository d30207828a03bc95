"""A stub OpenAI streaming server with a decode engine's cadence, to measure a client.

``python -m pdserve.bench.sse_stub --port P [--role mixed|decode|prefill] [--step-ms 9.4]
[--prefill-ms 20] [--head-early]``: one asyncio process, no model. A streamed
``POST /v1/completions`` (or ``/v1/chat/completions``) waits ``--prefill-ms``, then gets
one text chunk per engine step: one ticker writes a chunk to every open stream every
``--step-ms`` milliseconds, in one burst, as a decode engine's step does (128 chunks for
``max_tokens`` 128; the last one has ``finish_reason`` ``"length"``), then a usage chunk
and ``data: [DONE]``. Chunked transfer encoding, keep-alive, ``TCP_NODELAY`` (asyncio's
default for TCP).

The finished choice carries a pdserve-shaped timing block (``return_timing``'s, with no
phases) under its ``--role``: ``start_unix`` (the request's head arrived) and
``first_chunk_unix`` (the first text chunk was handed to the socket, Unix seconds), so
``pdserve bench serve --phase-timing`` against the stub reports ``to_client``: the time
from the server's write of the first chunk to the client having it, which on one machine
is the client's own lateness (and, with the stub behind a ``pdserve router``, the relay's
and the client's). ``--head-early``: the response head is written as the request arrives
(as a worker that starts its stream before the first token); by default it goes with the
first chunk (as the router's relay, which waits for the first chunk to answer an early
error with its status). ``--end-late``: the body's chunked terminator comes one step
after ``data: [DONE]`` (by default in the same write).

Also ``GET /health``, ``GET /v1/models`` (``stub``) and ``GET /get_server_info``
(``{"role": ..., "served_model_name": "stub"}``; a prefill role adds a bootstrap port),
so a ``pdserve router`` accepts it as a worker. Anything else: 404.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

_TEXT = " tok"  # one token's text in every chunk


def _response(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass
class _Stream:
    """One open streamed answer."""

    writer: asyncio.StreamWriter
    chat: bool
    max_tokens: int
    start_unix: float
    due: float  # loop time of the first token
    head_sent: bool
    sent: int = 0
    first_chunk_unix: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StubServer:
    """The stub's state: the open streams and the ticker writing their chunks.

    role: the timing block's key and ``/get_server_info``'s role; step_s: seconds between
    engine steps; prefill_s: seconds from a request's arrival to its first token's step
    (the first step at or after it); head_early: write the head at once (else with the
    first chunk); end_late: the body's chunked terminator one step after ``[DONE]`` (else
    in the same write)."""

    def __init__(
        self, role: str, step_s: float, prefill_s: float, head_early: bool, end_late: bool = False
    ) -> None:
        self.role, self.step_s, self.prefill_s, self.head_early = (
            role,
            step_s,
            prefill_s,
            head_early,
        )
        self.end_late = end_late
        self.ending: list[_Stream] = []  # [DONE] written, the terminator due next step
        self.streams: list[_Stream] = []
        self.created = int(time.time())

    def _chunk(self, s: _Stream, last: bool) -> bytes:
        choice: dict = {"index": 0, "finish_reason": "length" if last else None}
        if s.chat:
            choice["delta"] = {"content": _TEXT}
        else:
            choice["text"], choice["logprobs"] = _TEXT, None
        if last:
            choice["timing"] = {
                self.role: {
                    "phases": {},
                    "start_unix": s.start_unix,
                    "first_chunk_unix": s.first_chunk_unix,
                }
            }
        doc = {
            "id": "cmpl-stub",
            "object": "chat.completion.chunk" if s.chat else "text_completion",
            "created": self.created,
            "model": "stub",
            "choices": [choice],
        }
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def _usage(self, s: _Stream) -> bytes:
        doc = {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": self.created,
            "model": "stub",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": s.sent, "total_tokens": 1 + s.sent},
        }
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    async def tick(self) -> None:
        """Every ``step_s``: one chunk to every stream whose first token is due."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            now = loop.time()
            if now - next_at > self.step_s:  # fell behind (a busy machine): no catch-up burst
                next_at = now
            for s in self.ending:
                if not s.writer.is_closing():
                    s.writer.write(b"0\r\n\r\n")
                s.done.set()
            self.ending = []
            still = []
            for s in self.streams:
                if s.due > now:
                    still.append(s)
                    continue
                if s.writer.is_closing():
                    s.done.set()
                    continue
                s.sent += 1
                last = s.sent >= s.max_tokens
                data = _chunked(self._chunk(s, last))
                if last:
                    data += _chunked(self._usage(s)) + _chunked(b"data: [DONE]\n\n")
                    if not self.end_late:
                        data += b"0\r\n\r\n"
                if not s.head_sent:
                    data = _HEAD + data
                    s.head_sent = True
                if s.sent == 1:
                    s.first_chunk_unix = time.time()
                s.writer.write(data)
                if last and self.end_late:
                    self.ending.append(s)
                elif last:
                    s.done.set()
                else:
                    still.append(s)
            self.streams = still

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One keep-alive connection."""
        loop = asyncio.get_running_loop()
        info: dict[str, str | int] = {"role": self.role, "served_model_name": "stub"}
        if self.role == "prefill":
            info |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1}
        gets = {
            b"/health": _response(b'{"status":"ok"}'),
            b"/get_server_info": _response(json.dumps(info).encode()),
            b"/v1/models": _response(b'{"object":"list","data":[{"id":"stub","object":"model"}]}'),
        }
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                start_unix = time.time()
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                if method == b"GET":
                    writer.write(gets.get(path) or _response(b"{}", "404 Not Found"))
                    continue
                if path not in (b"/v1/completions", b"/v1/chat/completions"):
                    writer.write(_response(b"{}", "404 Not Found"))
                    continue
                req = json.loads(body or b"{}")
                if not req.get("stream"):
                    writer.write(
                        _response(b'{"error":{"message":"stream only"}}', "400 Bad Request")
                    )
                    continue
                s = _Stream(
                    writer,
                    chat=path == b"/v1/chat/completions",
                    max_tokens=max(1, int(req.get("max_tokens") or 16)),
                    start_unix=start_unix,
                    due=loop.time() + self.prefill_s,
                    head_sent=self.head_early,
                )
                if self.head_early:
                    writer.write(_HEAD)
                self.streams.append(s)
                await s.done.wait()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve_forever(port: int, server: StubServer) -> None:
    """Serve on 127.0.0.1:``port`` until cancelled."""
    ticker = asyncio.create_task(server.tick())
    srv = await asyncio.start_server(server.serve, "127.0.0.1", port, backlog=1024)
    try:
        async with srv:
            await srv.serve_forever()
    finally:
        ticker.cancel()


def main(argv: list[str] | None = None) -> None:
    """Command line (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.sse_stub", description=__doc__)
    p.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    p.add_argument("--role", default="mixed", choices=("mixed", "decode", "prefill"))
    p.add_argument("--step-ms", type=float, default=9.4, help="engine step, ms (default 9.4)")
    p.add_argument("--prefill-ms", type=float, default=20.0, help="first token after, ms")
    p.add_argument("--head-early", action="store_true", help="head written at once")
    p.add_argument("--end-late", action="store_true", help="terminator a step after [DONE]")
    args = p.parse_args(argv)
    stub = StubServer(
        args.role, args.step_ms / 1e3, args.prefill_ms / 1e3, args.head_early, args.end_late
    )
    try:
        try:
            import uvloop  # the servers' loop (uvicorn's)
        except ImportError:
            asyncio.run(serve_forever(args.port, stub))
        else:
            uvloop.run(serve_forever(args.port, stub))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
