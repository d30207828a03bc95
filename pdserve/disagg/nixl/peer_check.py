"""``pdserve doctor --peer HOST:PORT``: can this host reach a prefill worker's bootstrap
server and open a NIXL connection to it, and over which UCX transport?

Steps, each reported as one line: the bootstrap server's ``/health`` (status, instance,
protocol version); its rank 0 info (agent name, control endpoint, KV memory kind); a NIXL
agent of our own loads the peer's agent metadata and opens the connection
(``make_connection``); then a READ of one aux slot of the peer (host memory, only read,
so a serving worker is not disturbed) shows data moves, and UCX's protocol report
(:mod:`.agent.ucx_transports`) names the transport it used. The READ needs the peer's UCX
worker to make progress for transports without one-sided hardware support (TCP): a
prefill worker without NIXL's progress thread answers it once busy with transfers, so a
READ that times out on an idle peer is a warning, not a failure.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from pdserve.disagg.base import PROTOCOL_VERSION, Role
from pdserve.disagg.bootstrap import BootstrapClient, BootstrapError
from pdserve.disagg.transfer_config import NixlInitSpec
from pdserve.ports import check_port


@dataclass
class PeerReport:
    """Lines of the check (``ok``/``warn``/``fail``, text), and the transports seen."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    transports: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(kind != "fail" for kind, _ in self.lines)

    def add(self, kind: str, text: str) -> None:
        self.lines.append((kind, text))


def parse_peer(peer: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port). ValueError naming --peer."""
    host, sep, port = peer.rpartition(":")
    host = host.strip("[]")
    if sep and host and port.isdigit():
        try:
            return host, check_port(int(port), "--peer", allow_zero=False)
        except ValueError:
            pass
    raise ValueError(f"--peer must be HOST:PORT of a bootstrap server, got {peer!r}")


def check_peer(host: str, port: int, spec: NixlInitSpec, timeout_s: float = 10.0) -> PeerReport:
    """Run the checks of the module doc against the bootstrap server at ``host:port``,
    with an agent as ``spec`` says (a decode worker's, from the environment: the doctor).
    Never raises for a problem of the peer or of NIXL: they are ``fail`` lines."""
    from pdserve.disagg.nixl.agent.ucx_transports import UcxTransportLog

    ucx_log = UcxTransportLog.install()  # before NIXL loads UCX in this process
    report = PeerReport()
    client = BootstrapClient(timeout_s=timeout_s)
    try:
        health = client.health(host, port, timeout_s)
        report.add(
            "ok",
            f"bootstrap server {host}:{port} is reachable: status {health.status}, "
            f"instance {health.instance_id[:12]}, protocol {health.protocol_version}",
        )
        if health.protocol_version != PROTOCOL_VERSION:
            report.add(
                "fail",
                f"protocol_version: ours {PROTOCOL_VERSION} vs theirs {health.protocol_version}",
            )
            return report
        info = client.fetch_rank(host, port, 0)
        report.add(
            "ok",
            f"rank 0: NIXL agent {info.agent_name}, control endpoint {info.control_endpoint}, "
            f"KV in {info.kv.mem_type}",
        )
    except BootstrapError as exc:
        report.add("fail", str(exc))
        return report
    finally:
        client.close()
    _nixl_checks(report, info, spec, timeout_s)
    if ucx_log is not None:
        report.transports = ucx_log.snapshot()["endpoints"]
        for t in report.transports:
            report.add(
                "ok",
                f"UCX {t['locality']} endpoint {t['config']}: {t['operation'].split(' by ')[0]} "
                f"over {', '.join(t['transports']) or '(none)'}",
            )
    else:
        report.add("warn", "UCX_PROTO_INFO or UCX_LOG_FILE is set: transports not reported")
    return report


def _nixl_checks(report: PeerReport, info, spec: NixlInitSpec, timeout_s: float) -> None:
    from pdserve.disagg.nixl.agent.api import NixlUnavailableError, load_nixl_api

    try:
        api = load_nixl_api()
    except NixlUnavailableError as exc:
        report.add("fail", str(exc))
        return
    from pdserve.disagg.base import KVArgs, KVLayout
    from pdserve.disagg.nixl.agent.init import create_agent

    # The backend and its parameters as a worker here would have them (spec), on CPU.
    dummy = KVArgs((0,), (1,), (1,), 0, 1, 1, KVLayout("", "", 1, 1, 1, 1), device="cpu")
    try:
        name = f"pdserve-doctor-{uuid.uuid4().hex[:8]}"
        agent = create_agent(api, name, dummy, Role.DECODE, spec)
        name = agent.add_remote_agent(base64.b64decode(info.agent_metadata))
        name = name.decode() if isinstance(name, bytes) else name
        agent.make_connection(name)
    except Exception as exc:  # noqa: BLE001 - reported
        report.add("fail", f"NIXL connection to {info.agent_name}: {type(exc).__name__}: {exc}")
        return
    report.add("ok", f"NIXL connection to {name} opened")
    # READ one aux slot (host memory) of the peer into a buffer of ours.
    nbytes = min(info.aux.item_lens[0], 4096)
    buf = np.zeros(nbytes, dtype=np.uint8)
    reg = handle = None
    try:
        reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
        local = agent.get_xfer_descs([(buf.ctypes.data, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(info.aux.ptrs[0], nbytes, info.aux.dev_id)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, name)
        start = time.monotonic()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR") and time.monotonic() - start < timeout_s:
            time.sleep(0.001)
            state = agent.check_xfer_state(handle)
        if state == "DONE":
            ms = (time.monotonic() - start) * 1e3
            report.add("ok", f"NIXL READ of {nbytes} bytes from the peer done in {ms:.1f} ms")
        elif state == "ERR":
            report.add("fail", f"NIXL READ of {nbytes} bytes from the peer failed (ERR)")
        else:
            report.add(
                "warn",
                f"NIXL READ of {nbytes} bytes did not finish in {timeout_s:g} s (an idle peer "
                "makes no UCX progress over TCP; its own transfers will)",
            )
    except Exception as exc:  # noqa: BLE001 - reported
        report.add("fail", f"NIXL READ from the peer: {type(exc).__name__}: {exc}")
    finally:
        for step in (
            lambda: handle is not None and agent.release_xfer_handle(handle),
            lambda: reg is not None and agent.deregister_memory(reg),
            lambda: agent.remove_remote_agent(name),
        ):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort clean-up
                pass
