"""Sockets and uvicorn start-up shared by every HTTP server of pdserve (worker, router, bootstrap)."""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from typing import Any

import uvicorn

from pdserve import envs
from pdserve.http.read_timeout import (
    DEFAULT_REQUEST_READ_TIMEOUT_S,
    protocol_class,
    with_read_timeout,
)
from pdserve.tracing import RequestIdFilter


class PortInUseError(OSError):
    """A listening socket could not be bound on ``host:port``. The message names host, port,
    the system's reason and its likely cause; ``flag`` is the option to change: ``"port"``
    when the port is taken (EADDRINUSE), ``"host"`` when the host is not an address of
    this machine (EADDRNOTAVAIL) or does not resolve, ``None`` for another reason. (Its
    name is the commonest cause; every caller catches this one class.)"""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


def _bind_cause(host: str, port: int, exc: OSError) -> tuple[str, str | None]:
    """(likely cause for the message, option to change) of a failed ``bind``."""
    if isinstance(exc, socket.gaierror):
        return f"{host} is not an address or a host name this machine can resolve", "host"
    if exc.errno == errno.EADDRINUSE:
        return f"is another process using port {port}?", "port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine", "host"
    return "", None


# Seconds a stopped server (SIGTERM) gives its in-flight requests before it cuts them
# (uvicorn's timeout_graceful_shutdown); a router waits that long, and as long again, for a
# worker its health checks ejected before it sends the request elsewhere.
# PDSERVE_GRACEFUL_SHUTDOWN_S, default 5 (tests set less: they wait it out).
GRACEFUL_SHUTDOWN_S = envs.GRACEFUL_SHUTDOWN_S.get()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind a listening TCP socket on ``host:port`` (port 0 = a free one). Binding before
    the model loads makes a taken port fail fast. Raises PortInUseError naming host, port
    and the likely cause (a taken port, a host not of this machine), with the option to
    change in its ``flag``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on accepted sockets whose proto says TCP, and with Nagle on, an answer written as
    # head then body waits for the client's delayed ACK: 40 ms per request on Linux
    # (uvicorn binding itself gets IPPROTO_TCP from getaddrinfo; uvloop sets it always)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        cause, flag = _bind_cause(host, port, exc)
        raise PortInUseError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            + (f" ({cause})" if cause else ""),
            flag,
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


_RNG = random.SystemRandom()  # not the global generator, which tests and benches seed


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for a process about to listen on it.

    Picked at random below the kernel's ephemeral range (from 10000) and checked by binding:
    a port the kernel gave out (bind to 0) can be taken in the meantime by any outgoing
    connection on the machine, which made a starting server fail with "address in use"
    when many processes start at once. Falls back to the kernel's choice after 50 tries.
    """
    low = 10000
    high = _ephemeral_low() - 1
    for _ in range(50 if high > low else 0):
        port = _RNG.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def app_protocol(app: Any) -> Any:
    """The HTTP protocol class an app asks for (``app.state.http_protocol``: the router's
    front, pdserve/http/front.py), None when it asks for none."""
    return getattr(getattr(app, "state", None), "http_protocol", None)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins: ``app.state.before_shutdown()``
    (if the app defines it) runs on the event loop as soon as SIGINT/SIGTERM is handled,
    before uvicorn waits for in-flight requests (the router uses it to end open streams
    with an SSE error event and ``[DONE]`` instead of having them cut)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        hook = getattr(getattr(self.config.app, "state", None), "before_shutdown", None)
        if callable(hook):
            hook()
        await super().shutdown(sockets)


class _OtherThreadsOnly(logging.Filter):
    """Drops records of thread ``ident`` below ``level``: uvicorn logs every server's
    lifecycle lines ("Started server process", "Shutting down", "Finished server process")
    on the one process-wide ``uvicorn.error`` logger, whose level the main server sets, so a
    thread's server would repeat them among the worker's own."""

    def __init__(self, ident: int, level: int) -> None:
        super().__init__()
        self.ident, self.level = ident, level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.ident or record.levelno >= self.level


class ThreadedServer:
    """An ASGI ``app`` served by uvicorn (:class:`GracefulServer`) on a daemon thread of
    this process: the bootstrap server, and the in-process servers of the tests.

    The socket is bound in :meth:`start` (``port`` 0 = a free one; a taken port raises
    :class:`PortInUseError` naming it) before the thread starts, so no other process can
    take the port in between. ``config`` goes to ``uvicorn.Config`` (defaults: warnings
    only, no access log, 5 s graceful shutdown); its ``log_level`` holds for the lines its
    thread logs whatever level another server of the process set on uvicorn's loggers.
    ``request_read_timeout``: seconds a request may take to arrive
    (:mod:`pdserve.http.read_timeout`; 408 after).
    ``stop()`` asks uvicorn to exit, as SIGTERM does, and joins the thread.
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "pdserve-http",
        request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
        **config: Any,
    ) -> None:
        self.host, self.port, self.name = host, port, name
        options: dict[str, Any] = {
            "log_level": "warning",
            "access_log": False,
            "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
            "loop": "asyncio",  # uvicorn's "auto" would take uvloop/httptools when installed
            "http": app_protocol(app) or "h11",  # the router's front serves its requests
        }
        options.update(config)
        options["http"] = with_read_timeout(protocol_class(options["http"]), request_read_timeout)
        self.server = GracefulServer(uvicorn.Config(app, **options))
        level = options["log_level"]
        self._log_level = (
            level if isinstance(level, int) else logging.getLevelName(str(level).upper())
        )
        self.error: BaseException | None = None  # what ended the thread, if it failed
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> int:
        """Bind, start the thread and wait until uvicorn listens; returns the port.
        Raises PortInUseError for a taken port, OSError naming the address if the server
        does not start within ``timeout`` seconds."""
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]

        def run() -> None:
            quiet = _OtherThreadsOnly(threading.get_ident(), self._log_level)
            uvicorn_log = logging.getLogger("uvicorn.error")
            uvicorn_log.addFilter(quiet)
            try:
                self.server.run(sockets=[sock])
            except BaseException as exc:  # noqa: BLE001 - reported through is_alive()/error
                self.error = exc
            finally:
                sock.close()
                uvicorn_log.removeFilter(quiet)

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"HTTP server on {self.host}:{self.port} did not start: {self.error}")
            time.sleep(0.005)
        return self.port

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 15.0) -> None:
        """Ask uvicorn to exit (in-flight requests get the graceful-shutdown time) and join."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)


def serve_app(
    app,
    sock: socket.socket,
    *,
    log_level: str = "info",
    loop: str = "asyncio",
    http: str = "h11",
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
) -> None:
    """Run ``app`` under uvicorn on an already bound socket until SIGINT/SIGTERM.
    ``loop``/``http``: uvicorn's event loop and HTTP/1.1 parser; the router asks for
    ``auto`` = ``uvloop``/``httptools`` where installed (its whole job is parsing and relaying requests: they cut
    its CPU per request by about a third, ``pdserve bench router``), the workers keep the
    standard library's loop and h11. An app that names its own protocol class
    (``app.state.http_protocol``: the router's front) is served by that one.
    ``request_read_timeout``: seconds a request's head may take to arrive, and its body may
    pause (:mod:`pdserve.http.read_timeout`; 408 after)."""
    # In-flight streams get GRACEFUL_SHUTDOWN_S (5 s) to finish on SIGTERM; then the engine
    # thread is stopped.
    config = uvicorn.Config(
        app,
        log_level=log_level.lower(),
        access_log=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        loop=loop,
        http=with_read_timeout(protocol_class(app_protocol(app) or http), request_read_timeout),
    )
    server = GracefulServer(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised SIGINT
        pass


def configure_logging(level: str) -> None:
    """Log lines with time, process role, level and the request id of the API request
    being served (``-`` outside one; ``pdserve/tracing.py:RequestIdFilter``), at
    ``level`` (PDSERVE_LOG_LEVEL)."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
