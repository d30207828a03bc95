"""ZMQ plumbing of the control channel: a thread-safe outbox for the control thread,
which is the only thread touching its sockets (ZMQ sockets are not thread-safe)."""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

import zmq

_ids = itertools.count()


class Outbox:
    """Items other threads hand to the control thread. ``put`` enqueues and wakes it
    through an inproc socket that the control thread polls (``wake_socket``)."""

    def __init__(self, ctx: zmq.Context) -> None:
        addr = f"inproc://pdserve-outbox-{next(_ids)}"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_socket = ctx.socket(zmq.PULL)
        self.wake_socket.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 1)  # one pending wake-up is enough
        self._push.connect(addr)
        self._lock = threading.Lock()

    def put(self, item: Any) -> None:
        self._queue.put(item)
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # Again (a wake-up is pending) or closed at shutdown
                pass

    def drain(self) -> list[Any]:
        """Everything queued so far (control thread only)."""
        while True:
            try:
                self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.wake_socket.close(linger=0)


def recv_all(sock: zmq.Socket) -> list[list[bytes]]:
    """Every message waiting on ``sock`` (multipart frames), without blocking."""
    out = []
    while True:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return out
