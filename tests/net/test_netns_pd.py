"""PD across three "hosts" (network namespaces joined by veth pairs, 198.18.0.0/15): prefill
in one, decode in another, the router in a third, KV over real NIXL with UCX forced onto
TCP (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=eth0``: no shared memory, no loopback; the
namespaces share one kernel, so UCX would otherwise pick ``cma``). Nothing here can reach
another host over 127.0.0.1, so any assumed loopback address fails these tests.

Checks: the wildcard-bound prefill advertises its own address; PD output equals a mixed
worker's; a streamed request; an abort frees every KV page on both sides; the transports
UCX used are reported (``/get_server_info`` ``ucx``) and are TCP over eth0;
``pdserve doctor --peer`` from the decode host; a decode killed mid-stream gives the
client an SSE error event and ``[DONE]``, and the router and prefill live on.
When namespaces cannot be created (no root, no iproute2) the tests fail saying so.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import httpx
import pytest
from netns_cluster import BOOTSTRAP_PORT, TCP_ONLY, pd_cluster, run_in

from pdserve_procs import wait_for

pytestmark = pytest.mark.timeout(600)

LP_TOL = 2e-4  # prefill/decode batch shapes differ from the mixed worker's


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pd_cluster(tmp_path_factory.mktemp("netns-tcp"), TCP_ONLY, advertise_dns=False) as c:
        yield c


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120.0)


def _completion(prompt, **kw) -> dict:
    return {
        "prompt": prompt,
        "temperature": 0.0,
        "return_token_ids": True,
        "logprobs": 2,
        "max_tokens": 12,
        **kw,
    }


def _assert_same_choice(pd: dict, mixed: dict) -> None:
    a, b = pd["choices"][0], mixed["choices"][0]
    assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
    assert a["token_ids"] == b["token_ids"]
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
        assert abs(x - y) <= LP_TOL, (x, y)
    assert pd["usage"] == mixed["usage"]


def test_wildcard_prefill_advertises_its_own_address(cluster):
    p = cluster["topo"].hosts["prefill"]
    info = cluster["prefill"].get_info()
    assert info["bootstrap_host"] == p.address and info["bootstrap_port"] == BOOTSTRAP_PORT
    rank = httpx.get(f"http://{p.address}:{BOOTSTRAP_PORT}/route/0", timeout=10).json()
    assert rank["control_endpoint"].startswith(f"tcp://{p.address}:"), rank["control_endpoint"]
    r = run_in(
        p, sys.executable, "-c", "from pdserve.advertise import reachable_address as r; print(r())"
    )
    assert r.stdout.strip() == p.address, r  # no default route: the interface's address


@pytest.mark.parametrize(
    "body",
    [
        _completion("The capital of France is"),
        _completion("Once upon a time", max_tokens=1),
        _completion([5, 17, 300, 4000, 25], max_tokens=5),
        _completion("A seeded story", temperature=0.9, top_p=0.9, seed=1234),
    ],
    ids=["greedy", "max_tokens_1", "token_prompt", "seeded"],
)
def test_pd_across_hosts_equals_mixed(cluster, body):
    pd = _post(cluster["router"].url, "/v1/completions", body)
    mixed = _post(cluster["mixed"].url, "/v1/completions", body)
    assert pd.status_code == 200, pd.text
    assert mixed.status_code == 200, mixed.text
    _assert_same_choice(pd.json(), mixed.json())


def _sse_datas(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_streamed_request_across_hosts(cluster):
    body = _completion("Stream this please", max_tokens=10, logprobs=None)
    whole = _post(cluster["mixed"].url, "/v1/completions", body).json()["choices"][0]["text"]
    r = _post(cluster["router"].url, "/v1/completions", dict(body, stream=True))
    assert r.status_code == 200
    datas = _sse_datas(r.text)
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert len(chunks) >= 2


def _free_pages(cluster) -> dict[str, int]:
    return {n: cluster[n].get_info()["num_free_pages"] for n in ("prefill", "decode")}


def test_abort_mid_stream_frees_every_page_on_both_hosts(cluster):
    baseline = _free_pages(cluster)
    body = _completion("Abort me", max_tokens=1500, ignore_eos=True, logprobs=None, stream=True)
    url = cluster["router"].url + "/v1/completions"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break  # the client leaves mid-stream
    wait_for(lambda: _free_pages(cluster) == baseline, 120, "KV pages back on both sides")
    for n in ("prefill", "decode"):
        assert cluster[n].get_info()["transfer"]["live_rooms"] == 0
    r = _post(cluster["router"].url, "/v1/completions", _completion("After the abort"))
    assert r.status_code == 200, r.text


def test_ucx_used_tcp_over_eth0_and_says_so(cluster, record_property):
    ucx = cluster["prefill"].get_info()["ucx"]
    writes = [e for e in ucx["endpoints"] if e["operation"].startswith("remote memory write")]
    peer = [e for e in writes if e["locality"] != "self"]
    assert peer, ucx
    transports = sorted({t for e in peer for t in e["transports"]})
    record_property("ucx_transports_tcp_forced", transports)
    print(f"\nUCX_TLS=tcp: prefill -> decode writes used {transports}")
    assert all("tcp/eth0" in t and "cma" not in t and "tcp/lo" not in t for t in transports)
    log = cluster["prefill"].log_path.read_text()
    assert "endpoint" in log and "remote memory write over" in log and "tcp/eth0" in log


def test_doctor_peer_from_the_decode_host(cluster):
    p, d = (cluster["topo"].hosts[n] for n in ("prefill", "decode"))
    for peer in (f"{p.address}:{BOOTSTRAP_PORT}", f"{p.dns_name}:{BOOTSTRAP_PORT}"):
        r = run_in(
            d,
            sys.executable,
            "-m",
            "pdserve",
            "doctor",
            "--peer",
            peer,
            "--timeout",
            "30",
            env=TCP_ONLY,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert "bootstrap server" in r.stdout and "is reachable" in r.stdout
        assert "NIXL connection to pdserve-prefill-" in r.stdout
        assert "NIXL READ of" in r.stdout and "done in" in r.stdout, r.stdout
        assert "remote memory read over tcp/eth0" in r.stdout, r.stdout
    bad = run_in(d, sys.executable, "-m", "pdserve", "doctor", "--peer", f"{p.address}:1")
    assert bad.returncode == 1 and "PROBLEM: " in bad.stdout and "refused" in bad.stdout, bad


def test_decode_killed_mid_stream_ends_with_an_error_event(cluster):
    """Last in the module: it kills the decode worker."""
    body = _completion("Kill decode", max_tokens=1500, ignore_eos=True, logprobs=None, stream=True)
    datas: list[str] = []
    url = cluster["router"].url + "/v1/completions"
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            datas.append(line[6:])
            if len(datas) == 3:
                os.killpg(cluster["decode"].popen.pid, signal.SIGKILL)
    assert datas[-1] == "[DONE]", datas[-3:]
    error = json.loads(datas[-2])
    assert error["error"]["type"] == "bad_gateway" and "decode worker" in error["error"]["message"]
    cluster["decode"].popen.wait(timeout=30)
    wait_for(
        lambda: httpx.get(cluster["router"].url + "/health", timeout=10).status_code == 503,
        60,
        "the router to eject the dead decode",
    )
    assert cluster["prefill"].health_problem() is None
    wait_for(
        lambda: cluster["prefill"].get_info()["transfer"]["live_rooms"] == 0,
        120,
        "prefill to end the room of the dead decode",
    )
