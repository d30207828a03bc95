"""Hosts on one machine: Linux network namespaces joined by veth pairs to a bridge.

:class:`Topology` creates one namespace per named host plus a ``switch`` namespace holding
a bridge; each host gets ``eth0`` with an address of its own /24 in 198.18.0.0/15 (RFC 2544's
range for network benchmarks, never routed), loopback up, no default route. The test
process (root namespace) reaches every host through one more veth (``.254``). Names in
``/etc/netns/<ns>/hosts`` give each host DNS names for the others (``ip netns exec``
bind-mounts that file over ``/etc/hosts``).

Every name carries this process's pid, so parallel runs do not collide, and a run sweeps
namespaces left behind by dead ones. ``close()`` (also on any exception in ``__enter__``)
removes the namespaces, veths and hosts files. Needs root and iproute2; :func:`problem`
says in one line why namespaces cannot be made here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "pdnet"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def problem() -> str | None:
    """None when network namespaces can be created here, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root; this test runs as uid {os.geteuid()}"
    name = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
    try:
        r = _ip("-n", name, "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = subprocess.run(
            ["ip", "netns", "exec", name, "true"], capture_output=True, text=True, timeout=30
        )
        if r.returncode != 0:
            return f"`ip netns exec` failed: {r.stderr.strip() or r.returncode}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces (and hosts files) of earlier runs whose process is gone, killing
    the processes still running inside them."""
    out = _ip("netns", "list", check=False).stdout
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:  # servers a killed run left running in its namespace
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One namespace: its name, its address and the DNS name the others know it by."""

    ns: str
    address: str
    dns_name: str

    def argv(self, *cmd: str, env: dict[str, str] | None = None) -> list[str]:
        """``cmd`` run inside this namespace with ``env`` added."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["ip", "netns", "exec", self.ns, "env", *extra, *cmd]


@dataclass
class Topology:
    """Hosts ``names`` on one bridge (see module doc); use as a context manager."""

    names: tuple[str, ...]
    hosts: dict[str, Host] = field(default_factory=dict)
    _created: list[str] = field(default_factory=list)
    _root_veth: str = ""

    def __post_init__(self) -> None:
        pid = os.getpid()
        n = pid % 510 + 1  # one /24 of 198.18.0.0/15 per run
        self.subnet = f"198.{18 + n // 256}.{n % 256}"
        self.tag = f"{PREFIX}{pid}"
        self.root_address = f"{self.subnet}.254"

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, suffix: str) -> str:
        ns = f"{self.tag}-{suffix}"
        _ip("netns", "add", ns)
        self._created.append(ns)
        return ns

    def _veth_to_switch(self, switch: str, inner: str, ns: str | None, index: int) -> None:
        a, b = f"{self.tag[-7:]}a{index}", f"{self.tag[-7:]}b{index}"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        if ns is None:
            self._root_veth = a
        _ip("link", "set", b, "netns", switch)
        _ip("-n", switch, "link", "set", b, "master", "br0", "up")
        if ns is not None:
            _ip("link", "set", a, "netns", ns)
            _ip("-n", ns, "link", "set", a, "name", inner)

    def _build(self) -> None:
        sweep_stale()
        switch = self._add_ns("switch")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names, start=1):
            ns = self._add_ns(name)
            self._veth_to_switch(switch, "eth0", ns, i)
            addr = f"{self.subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(ns, addr, f"{name}.pdnet.test")
        self._veth_to_switch(switch, "", None, 0)
        _ip("addr", "add", f"{self.root_address}/24", "dev", self._root_veth)
        _ip("link", "set", self._root_veth, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.dns_name} {name}\n" for name, h in self.hosts.items()
        )
        for h in self.hosts.values():
            d = Path("/etc/netns") / h.ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(hosts)

    def close(self) -> None:
        """Remove every namespace, veth and hosts file this topology made (idempotent)."""
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)  # takes its veth ends (and their peers) along
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self._root_veth:
            _ip("link", "del", self._root_veth, check=False)
        self._created.clear()

    def leftovers(self) -> list[str]:
        """Namespaces or the root veth of this topology that still exist (for the tests)."""
        names = _ip("netns", "list", check=False).stdout.split()
        left = [n for n in names if n.startswith(self.tag + "-")]
        if self._root_veth and _ip("link", "show", self._root_veth, check=False).returncode == 0:
            left.append(self._root_veth)
        return left
