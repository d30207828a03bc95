"""Advertised addresses: explicit wins, concrete listen addresses advertise themselves, a
wildcard never advertises itself; config and CLI carry the listen/advertise split."""

from __future__ import annotations

import argparse

import pytest

from pdserve import advertise
from pdserve.advertise import advertised_host, is_loopback, url_host
from pdserve.config import DisaggConfig
from pdserve.server.launch import add_parser, configs_from_args


def test_explicit_advertise_host_wins_over_any_listen_address():
    assert advertised_host("0.0.0.0", "prefill-0.pd.svc") == "prefill-0.pd.svc"
    assert advertised_host("198.18.0.2", "198.18.0.9") == "198.18.0.9"
    assert advertised_host("::", "[fd00::2]") == "fd00::2"


def test_concrete_listen_address_is_advertised_as_is():
    assert advertised_host("198.18.0.2") == "198.18.0.2"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("[fd00::2]") == "fd00::2"


def test_wildcard_is_never_advertised(monkeypatch):
    monkeypatch.setattr(advertise, "_default_route_address", lambda ipv6: None)
    monkeypatch.setattr(advertise, "_interface_addresses", lambda: ["198.18.7.2", "10.0.0.1"])
    assert advertised_host("0.0.0.0") == "198.18.7.2"
    monkeypatch.setattr(advertise, "_default_route_address", lambda ipv6: "198.19.0.5")
    assert advertised_host("0.0.0.0") == "198.19.0.5"


def test_wildcard_with_no_network_falls_back_to_loopback_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(advertise, "_default_route_address", lambda ipv6: None)
    monkeypatch.setattr(advertise, "_interface_addresses", lambda: [])
    monkeypatch.setattr(advertise.socket, "gethostbyname", lambda name: "127.0.1.1")
    with caplog.at_level("WARNING"):
        assert advertised_host("0.0.0.0") == "127.0.0.1"
    assert "--disaggregation-advertise-host" in caplog.text


def test_real_interfaces_have_no_loopback_and_default_route_is_not_loopback():
    # Whatever this machine has: the helpers never hand out a loopback address.
    assert not any(is_loopback(a) for a in advertise._interface_addresses())
    found = advertise._default_route_address(False)
    assert found is None or not is_loopback(found)


def test_url_host_brackets_ipv6_only():
    assert url_host("fd00::2") == "[fd00::2]"
    assert url_host("[fd00::2]") == "[fd00::2]"
    assert url_host("198.18.0.2") == "198.18.0.2"
    assert url_host("prefill-0") == "prefill-0"


@pytest.mark.parametrize("bad", ["", "0.0.0.0", "::"])
def test_config_rejects_unreachable_advertise_host(bad):
    with pytest.raises(ValueError, match="advertise_host"):
        DisaggConfig(role="prefill", advertise_host=bad)


def test_default_listen_address_stays_loopback():
    assert DisaggConfig().bootstrap_host == "127.0.0.1"
    assert DisaggConfig().advertise_host is None


def test_serve_flags_carry_listen_and_advertise_hosts():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "serve",
            "--role",
            "prefill",
            "--host",
            "0.0.0.0",
            "--disaggregation-bootstrap-host",
            "0.0.0.0",
            "--disaggregation-advertise-host",
            "prefill-0.pd.svc",
        ]
    )
    _, server, disagg = configs_from_args(args)
    assert (server.host, disagg.bootstrap_host, disagg.advertise_host) == (
        "0.0.0.0",
        "0.0.0.0",
        "prefill-0.pd.svc",
    )


@pytest.mark.parametrize(
    ("url", "advertised", "expected"),
    [
        ("http://198.18.0.2:30000", "198.18.0.2", "198.18.0.2"),
        ("http://prefill-0.pd.svc:30000", "10.1.2.3", "10.1.2.3"),  # pod IP over the URL's
        ("http://prefill-0.pd.svc:30000", "127.0.0.1", "prefill-0.pd.svc"),
        ("http://prefill-0.pd.svc:30000", "127.0.1.1", "prefill-0.pd.svc"),  # Debian's hostname
        ("http://prefill-0.pd.svc:30000", "0.0.0.0", "prefill-0.pd.svc"),
        ("http://127.0.0.1:30000", "127.0.0.1", "127.0.0.1"),
        ("http://198.18.0.2:30000", None, "198.18.0.2"),
    ],
)
def test_router_sends_decode_the_advertised_or_the_urls_host(url, advertised, expected):
    from pdserve.router.workers import WorkerState, bootstrap_address

    w = WorkerState(
        url, "prefill", server_info={"bootstrap_host": advertised, "bootstrap_port": 8998}
    )
    assert bootstrap_address(w) == (expected, 8998)
