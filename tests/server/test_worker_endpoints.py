"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP: --num-threads, a
client disconnect aborts the request and frees its pages; health, metrics, /v1/models, a
request's PD fields ignored by a mixed worker, /get_server_info, /tokenize, /detokenize and
/version."""

from __future__ import annotations

import threading

import httpx
import pytest
from http_calls import post

from pdserve_procs import Proc, wait_for

pytestmark = pytest.mark.timeout(300)


def test_num_threads_flag_sets_torch_threads(worker):
    assert worker.get_info()["num_threads"] == 1


def _engine(worker: Proc) -> dict:
    return worker.get_info()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_and_frees_pages(worker, stream):
    baseline = _engine(worker)["num_total_pages"]
    body = {
        "prompt": "go on",
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.Client(timeout=60) as client:
        if stream:
            with client.stream("POST", worker.url + "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    break  # first chunk seen: request is running; leaving closes the connection
        else:

            def cancel_once_running():  # leave once the engine runs the request
                wait_for(lambda: _engine(worker)["engine"]["num_running"] >= 1, 60, "it to run")
                client.close()

            threading.Thread(target=cancel_once_running, daemon=True).start()
            with pytest.raises(httpx.HTTPError):
                client.post(worker.url + "/v1/completions", json=body)
    wait_for(
        lambda: (
            _engine(worker)["engine"]["num_running"] == 0
            and _engine(worker)["num_free_pages"] == baseline
        ),
        30,
        "the aborted request to release its pages",
    )
    generated = _engine(worker)["engine"]["generation_tokens"]
    # Nothing is still decoding: a probe request runs through the engine after the abort,
    # and the token counter then moved by exactly the probe's tokens.
    probe = post(worker, "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    n = probe.json()["usage"]["completion_tokens"]
    wait_for(
        lambda: _engine(worker)["engine"]["generation_tokens"] >= generated + n,
        30,
        "the probe's tokens to be counted",
    )
    assert _engine(worker)["engine"]["generation_tokens"] == generated + n


def test_health_metrics_models_and_pd_fields_ignored(worker):
    assert httpx.get(worker.url + "/health_generate", timeout=30).status_code == 200
    models = httpx.get(worker.url + "/v1/models").json()
    assert models["data"][0]["id"] == "random:tiny"
    r = post(
        worker,
        "/v1/completions",
        {
            "prompt": "x",
            "max_tokens": 2,
            "bootstrap_host": "h",
            "bootstrap_port": 1234,
            "bootstrap_room": 7,
        },
    )
    assert r.status_code == 200  # a mixed worker ignores the PD fields
    text = httpx.get(worker.url + "/metrics").text
    for name in (
        "pdserve_requests_total",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_prompt_tokens_total",
        "pdserve_generation_tokens_total",
        "pdserve_engine_num_running",
        "pdserve_engine_num_waiting",
        "pdserve_engine_num_free_pages",
        "pdserve_request_latency_seconds_bucket",
    ):
        assert name in text, name
    info = worker.get_info()
    assert (
        info["role"] == "mixed"
        and info["layout"]["page_size"] == 16
        and info["bootstrap_port"] is None
    )


def test_tokenize_detokenize_version_and_models(worker):
    r = post(worker, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == worker.get_info()["max_model_len"]
    comp = post(
        worker,
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert body["tokens"] == comp["choices"][0]["prompt_token_ids"]
    back = post(worker, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello there"}
    msgs = [{"role": "user", "content": "Hi!"}]
    chat = post(worker, "/tokenize", {"messages": msgs}).json()
    chat_comp = post(
        worker,
        "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert chat["tokens"] == chat_comp["choices"][0]["prompt_token_ids"]
    assert chat["token_strs"] is None
    assert httpx.get(worker.url + "/version").json()["version"] == worker.get_info()["version"]
    model = httpx.get(worker.url + "/v1/models").json()["data"][0]
    assert model["max_model_len"] == worker.get_info()["max_model_len"]


def test_every_error_body_has_the_request_id_of_its_header(worker):
    """Unknown paths (404), a model that is not served (404), a wrong method (405), a bad
    body (400): each body's top-level ``request_id`` is the answer's ``x-request-id`` (the
    caller's when given), as for every other error."""
    cases = [
        ("GET", "/v1/nothing", None, 404, "Not Found: GET /v1/nothing"),
        ("GET", "/v1/models/foo", None, 404, "'foo' does not exist"),
        ("GET", "/v1/responses/resp_none", None, 404, "resp_none"),
        ("POST", "/health", None, 405, "Method Not Allowed: POST /health"),
        ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
        ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ]
    for method, path, body, status, words in cases:
        for given in (None, "probe-id-1"):
            headers = {"x-request-id": given} if given else {}
            r = httpx.request(method, worker.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == status, (path, r.text)
            assert words in r.json()["error"]["message"], (path, r.text)
            assert r.json()["request_id"] == r.headers["x-request-id"], (path, r.text)
            if given:
                assert r.headers["x-request-id"] == given


def test_head_answers_like_get_without_a_body(worker):
    """``HEAD`` of the probe paths (load balancers, Kubernetes) is GET's status and headers
    with no body; a path without GET stays a 405."""
    with httpx.Client(base_url=worker.url, timeout=30) as client:
        for path in ("/health", "/v1/models", "/v1/models/random:tiny", "/metrics", "/version"):
            get, head = client.get(path), client.head(path)
            assert get.status_code == head.status_code == 200, (path, head.text)
            assert head.content == b"" and get.content, path
            assert head.headers["content-type"] == get.headers["content-type"], path
            if path != "/metrics":  # its counters may move between the two
                assert head.headers["content-length"] == str(len(get.content)), path
        missing = client.head("/v1/models/foo")
        assert missing.status_code == 404 and missing.content == b""
        post_only = client.head("/v1/completions")
        assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"
        assert client.get("/health").json() == {"status": "ok"}  # the connection still serves
