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


def test_bound_sockets_serve_with_nagle_off():
    """An asyncio server on ``bind_socket``'s socket (as uvicorn runs on it) accepts
    connections with TCP_NODELAY set: with Nagle on, an answer written as head then body
    waited for the client's delayed ACK, 40 ms per keep-alive request."""
    import asyncio
    import socket

    from pdserve.http.netutil import bind_socket

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == 1


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    """A port outgoing connections cannot take between the pick and the listen."""
    from pdserve.http.netutil import _ephemeral_low, free_port

    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < _ephemeral_low() for p in ports), ports
    assert len(ports) > 1  # random, not one fixed port for every caller
    for port in list(ports)[:3]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
