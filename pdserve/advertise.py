"""Which address a worker tells its peers, given the address it listens on.

A worker listens on a configured address (``--host``, ``--disaggregation-bootstrap-host``)
and advertises one that peers on other hosts can reach (``/get_server_info``'s
``bootstrap_host``, the ZMQ control endpoint in the bootstrap rank info). An explicit
``--disaggregation-advertise-host`` wins; otherwise a concrete listen address is its own
advertised address, and a wildcard (``0.0.0.0``, ``::``) resolves to this host's address
on the network: the source address of the default route, else the first non-loopback
IPv4 address of an interface that is up, else the host name's address, else loopback.
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import logging
import socket
import struct

log = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")

# ioctl numbers of Linux's <linux/sockios.h>.
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1


@functools.lru_cache(maxsize=1024)  # the router asks for each PD request's prefill host
def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _default_route_address(ipv6: bool) -> str | None:
    """Source address the kernel picks towards a documentation address (no packet sent)."""
    family, target = (socket.AF_INET6, "2001:db8::1") if ipv6 else (socket.AF_INET, "192.0.2.1")
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP connect only selects the route
            addr = s.getsockname()[0]
    except OSError:  # no route (e.g. a namespace without a default route)
        return None
    return None if is_loopback(addr) else addr


def _interface_addresses() -> list[str]:
    """IPv4 addresses of interfaces that are up, loopback excluded (Linux ioctls)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                if not flags & _IFF_UP:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on this interface
                continue
            if not is_loopback(addr):
                out.append(addr)
    return out


def reachable_address(ipv6: bool = False) -> str:
    """This host's address for peers on other hosts (see the module doc for the order)."""
    found = _default_route_address(ipv6)
    if found is None and not ipv6:
        found = next(iter(_interface_addresses()), None)
    if found is None:
        try:
            addr = socket.gethostbyname(socket.gethostname())
            found = None if is_loopback(addr) else addr
        except OSError:
            found = None
    if found is None:
        found = "::1" if ipv6 else "127.0.0.1"
        log.warning(
            "no non-loopback address found to advertise; peers on other hosts cannot reach "
            "%s (set --disaggregation-advertise-host)",
            found,
        )
    return found


def advertised_host(listen_host: str, advertise_host: str | None = None) -> str:
    """The address peers should use for a server listening on ``listen_host``:
    ``advertise_host`` when given, ``listen_host`` when it is concrete, else
    :func:`reachable_address`. Returned without IPv6 brackets (see :func:`url_host`)."""
    if advertise_host:
        return advertise_host.strip("[]")
    if listen_host in WILDCARDS:
        return reachable_address(ipv6=listen_host == "::")
    return listen_host.strip("[]")


def url_host(host: str) -> str:
    """``host`` as it goes into a URL or a ZMQ endpoint: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
