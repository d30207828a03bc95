"""The namespace deployment of test_netns_pd.py with UCX left to choose its transports
(no ``UCX_TLS``/``UCX_NET_DEVICES``) and prefill advertising a DNS name: PD still equals
mixed, and ``/get_server_info`` plus ``pdserve doctor --peer`` say which transport UCX
chose between the namespaces (they share one kernel, so UCX may take ``cma`` shared
memory rather than TCP: exactly what an operator needs to see)."""

from __future__ import annotations

import sys

import httpx
import pytest
from netns_cluster import BOOTSTRAP_PORT, pd_cluster, run_in

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pd_cluster(tmp_path_factory.mktemp("netns-default"), {}, advertise_dns=True) as c:
        yield c


def test_pd_equals_mixed_and_the_chosen_transport_is_reported(cluster, record_property):
    p = cluster["topo"].hosts["prefill"]
    info = cluster["prefill"].get_info()
    assert info["bootstrap_host"] == p.dns_name  # the explicit advertise host, a DNS name
    rank = httpx.get(f"http://{p.address}:{BOOTSTRAP_PORT}/route/0", timeout=10).json()
    assert rank["control_endpoint"].startswith(f"tcp://{p.dns_name}:")
    body = {
        "prompt": "The capital of France is",
        "temperature": 0.0,
        "max_tokens": 12,
        "return_token_ids": True,
    }
    pd = httpx.post(cluster["router"].url + "/v1/completions", json=body, timeout=120)
    mixed = httpx.post(cluster["mixed"].url + "/v1/completions", json=body, timeout=120)
    assert pd.status_code == 200 and mixed.status_code == 200, (pd.text, mixed.text)
    assert pd.json()["choices"][0]["token_ids"] == mixed.json()["choices"][0]["token_ids"]

    ucx = cluster["prefill"].get_info()["ucx"]
    peer = [
        e
        for e in ucx["endpoints"]
        if e["locality"] != "self" and e["operation"].startswith("remote memory write")
    ]
    assert peer and all(e["transports"] for e in peer), ucx
    chosen = sorted({t for e in peer for t in e["transports"]})
    record_property("ucx_transports_default", chosen)
    print(f"\nUCX left to choose: prefill -> decode writes used {chosen} ({peer[0]['locality']})")


def test_doctor_peer_by_dns_name_reports_the_transport(cluster):
    p, d = (cluster["topo"].hosts[n] for n in ("prefill", "decode"))
    r = run_in(
        d,
        sys.executable,
        "-m",
        "pdserve",
        "doctor",
        "--peer",
        f"{p.dns_name}:{BOOTSTRAP_PORT}",
        "--timeout",
        "30",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "NIXL READ of" in r.stdout and "done in" in r.stdout, r.stdout
    read = [line for line in r.stdout.splitlines() if "remote memory read over" in line]
    assert read, r.stdout
    print("\n" + "\n".join(read))
