"""Which UCX transports NIXL's UCX backend chose, read from UCX's own protocol report.

UCX prints, for each endpoint configuration and operation it selects protocols for, a
table naming the transport per message-size range (``UCX_PROTO_INFO``; UCX >= 1.15). A
worker sets ``UCX_PROTO_INFO='*remote memory*'`` (only the RMA tables: writes/reads of KV
pages) and ``UCX_LOG_FILE`` to a file of its own before UCX loads, unless the user set
either of them; :meth:`UcxTransportLog.poll` parses the file, logs one line per new
endpoint configuration (its locality — ``self``, ``intra-node``, ``inter-node`` — and
transports such as ``tcp/eth0``, ``cma/memory``, ``rc_mlx5/mlx5_0:1``) and passes every
other UCX line (warnings, errors) on to this process's log, so redirecting UCX's log
hides nothing. ``/get_server_info`` reports :meth:`snapshot`.

An endpoint configuration is shared by every peer reached the same way, so a worker with
several peers reports one entry per distinct way, not per peer.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PATTERN = "*remote memory*"
# "[1796116864.044009] [vm:7826 :0]   | a self cfg#0 |"
_LINE = re.compile(r"^(\[[^\]]*\]\s*\[[^\]]*\])\s*(.*)$")


@dataclass(frozen=True)
class EndpointTransports:
    """One UCX protocol table: ``agent`` (the NIXL agent / UCP context name),
    ``locality`` (``self``/``intra-node``/``inter-node``), ``config`` (``cfg#N``),
    ``operation`` (e.g. ``remote memory write by ucp_put* from host memory to host``),
    ``transports`` (distinct transport/device columns, in table order)."""

    agent: str
    locality: str
    config: str
    operation: str
    transports: tuple[str, ...]


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def parse_table(rows: list[str]) -> EndpointTransports | None:
    """One table from its ``|``-rows (borders dropped); None when it is not a protocol table."""
    if len(rows) < 4:
        return None
    title = rows[0].strip().strip("|").split()
    if len(title) < 2 or not title[-1].startswith("cfg#"):
        return None
    agent, locality = (title[0], " ".join(title[1:-1])) if len(title) > 2 else ("", title[0])
    operation = rows[1].strip().strip("|").strip()
    transports: list[str] = []
    for row in rows[3:]:  # rows[2] is the "Range | Description | Config" header
        cells = _cells(row)
        if len(cells) >= 3 and cells[-1] and cells[-1] not in transports:
            transports.append(cells[-1])
    return EndpointTransports(agent, locality, title[-1], operation, tuple(transports))


def parse_lines(lines: list[str]) -> tuple[list[EndpointTransports], list[str]]:
    """Split UCX log lines into protocol tables (grouped by their shared timestamp prefix)
    and the other lines (returned for relaying)."""
    tables: list[EndpointTransports] = []
    other: list[str] = []
    group_key, rows = None, []  # type: ignore[var-annotated]

    def flush() -> None:
        if rows:
            table = parse_table(rows)
            if table is not None:
                tables.append(table)
        rows.clear()

    for line in lines:
        m = _LINE.match(line.rstrip("\n"))
        body = m.group(2) if m else line.strip()
        if m and body[:1] in ("|", "+"):
            if m.group(1) != group_key:
                flush()
                group_key = m.group(1)
            if body.startswith("|"):
                rows.append(body)
            continue
        flush()
        group_key = None
        if line.strip():
            other.append(line.rstrip("\n"))
    flush()
    return tables, other


def _flush_c_streams() -> None:
    """``fflush(NULL)``: flush every C stdio output stream of this process (UCX writes its
    log with ``fprintf`` to a fully buffered ``FILE``; Python's own streams are not C's)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library symbols: tables arrive when flushed
        pass


class UcxTransportLog:
    """The UCX protocol report of this process (see module doc). Build with :meth:`install`
    before NIXL/UCX is loaded; ``poll`` is safe from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self._seen: dict[tuple[str, str, str, str], EndpointTransports] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def install(cls, directory: str | None = None) -> UcxTransportLog | None:
        """Point UCX's protocol report at a file of this process; None (nothing changed)
        when the user set ``UCX_PROTO_INFO`` or ``UCX_LOG_FILE`` themselves."""
        if "UCX_PROTO_INFO" in os.environ or "UCX_LOG_FILE" in os.environ:
            return None
        path = Path(directory or tempfile.gettempdir()) / f"pdserve-ucx-{os.getpid()}.log"
        path.write_text("")
        os.environ["UCX_PROTO_INFO"] = PATTERN
        os.environ["UCX_LOG_FILE"] = str(path)
        report = cls(path)
        atexit.register(report.close)  # also a process that never start()s (doctor --peer)
        return report

    def poll(self) -> list[EndpointTransports]:
        """Read what UCX wrote since the last call; log new endpoint configurations and
        relay other UCX lines. Returns the new configurations."""
        with self._lock:
            _flush_c_streams()  # UCX's log FILE is block-buffered (4 KiB)
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    f.seek(self._offset)
                    data = f.read()
                    self._offset = f.tell()
            except OSError:
                return []
            data, self._partial = self._partial + data, ""
            if data and not data.endswith("\n"):
                data, _, self._partial = data.rpartition("\n")
            tables, other = parse_lines(data.splitlines())
            new = []
            for t in tables:
                key = (t.agent, t.locality, t.config, t.operation)
                if key not in self._seen:
                    self._seen[key] = t
                    new.append(t)
        for line in other:
            log.warning("UCX: %s", line)
        for t in new:
            log.info(
                "UCX %s endpoint %s of %s: %s over %s",
                t.locality,
                t.config,
                t.agent,
                t.operation.split(" by ")[0],
                ", ".join(t.transports) or "(none)",
            )
        return new

    def snapshot(self) -> dict:
        """``{"log_file": ..., "endpoints": [EndpointTransports as dicts]}`` after a poll."""
        self.poll()
        with self._lock:
            endpoints = [
                dict(asdict(t), transports=list(t.transports)) for t in self._seen.values()
            ]
        return {"log_file": str(self.path), "endpoints": endpoints}

    def start(self, interval_s: float = 1.0) -> None:
        """Poll on a daemon thread every ``interval_s`` (UCX's warnings reach the log soon)."""

        def run() -> None:
            while not self._stop.wait(interval_s):
                self.poll()

        self._thread = threading.Thread(target=run, name="pdserve-ucx-log", daemon=True)
        self._thread.start()
        # An interpreter exit that runs atexit (doctor --peer, a failed start-up, SIGINT's
        # KeyboardInterrupt); uvicorn ends a SIGTERM by re-raising it with the default
        # handler (no atexit), so a worker also calls close() at its app's lifespan end.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the thread, relay what is left, delete the file (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.poll()
        self.path.unlink(missing_ok=True)
