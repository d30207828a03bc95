"""``bind_socket``'s errors name the cause a user can act on: a taken port (change
``--port``), a host that is not an address of this machine or does not resolve (change
``--host``)."""

from __future__ import annotations

import socket

import pytest

from pdserve.http.netutil import PortInUseError, bind_socket


def test_a_taken_port_names_the_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError) as exc:
            bind_socket("127.0.0.1", port)
    assert exc.value.flag == "port"
    assert str(exc.value) == (
        f"cannot listen on 127.0.0.1:{port}: Address already in use "
        f"(is another process using port {port}?)"
    )


def test_an_address_not_of_this_machine_names_the_host() -> None:
    with pytest.raises(PortInUseError) as exc:
        bind_socket("192.0.2.1", 0)  # TEST-NET-1 (RFC 5737): never a local address
    assert exc.value.flag == "host"
    assert str(exc.value) == (
        "cannot listen on 192.0.2.1:0: Cannot assign requested address "
        "(192.0.2.1 is not an address of this machine)"
    )


def test_a_host_name_that_does_not_resolve_names_the_host() -> None:
    with pytest.raises(PortInUseError) as exc:
        bind_socket("no-such-host.invalid", 0)  # .invalid never resolves (RFC 6761)
    assert exc.value.flag == "host"
    assert "no-such-host.invalid is not an address or a host name" in str(exc.value)
    assert "port" not in str(exc.value).split(":", 2)[-1]


def test_a_local_address_binds() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()
