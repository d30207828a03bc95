"""The request field policy: unknown fields found at every depth, ignored with a counter
(labels capped) or rejected under ``--strict-request-fields`` by a real worker."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.server.field_policy import MAX_FIELD_LABELS, FieldPolicy, unknown_fields
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from pdserve.server.serving import APIError
from pdserve_procs import assert_all_healthy, start_worker, stop, wait_healthy

pytestmark = pytest.mark.timeout(300)


def _counter() -> Counter:
    return Counter("ignored", "x", ["field"], registry=CollectorRegistry())


def test_unknown_fields_at_every_depth_and_noop_fields_are_known():
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "a", "refusal": None},
                {"role": "user", "content": [{"type": "text", "text": "b", "cache": 1}]},
            ],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True, "z": 1},
            "user": "u",
            "metadata": {"free": "form"},
            "store": True,
            "service_tier": "auto",
            "parallel_tool_calls": True,
            "reasoning_effort": "low",
            "new_thing": 3,
        }
    )
    assert sorted(unknown_fields(chat)) == [
        "messages.content.cache",
        "messages.refusal",
        "new_thing",
        "stream_options.z",
    ]
    gen = GenerateRequest.model_validate({"text": "a", "sampling_params": {"regex_x": "a"}})
    assert unknown_fields(gen) == ["sampling_params.regex_x"]
    assert unknown_fields(CompletionRequest.model_validate({"prompt": "a", "echo": True})) == []


def test_policy_counts_ignored_fields_with_capped_labels_or_rejects_them():
    counter = _counter()
    policy = FieldPolicy(False, counter)
    for i in range(MAX_FIELD_LABELS + 5):
        policy.apply(CompletionRequest.model_validate({"prompt": "a", f"f{i}": 1}), "/x")
    policy.apply(CompletionRequest.model_validate({"prompt": "a", "f0": 1}), "/x")
    assert counter.labels("f0")._value.get() == 2
    assert counter.labels("other")._value.get() == 5
    strict = FieldPolicy(True, _counter())
    with pytest.raises(APIError) as exc:
        strict.apply(CompletionRequest.model_validate({"prompt": "a", "b": 1, "c": 2}), "/x")
    assert exc.value.status == 400 and exc.value.param == "b" and "b, c" in exc.value.message
    strict.apply(CompletionRequest.model_validate({"prompt": "a", "user": "u"}), "/x")


@pytest.fixture(scope="module")
def strict_worker(tmp_path_factory):
    proc = start_worker(
        "strict",
        "mixed",
        tmp_path_factory.mktemp("strict-logs"),
        extra=["--strict-request-fields", "--num-threads", "1"],
    )
    try:
        wait_healthy([proc])
        yield proc
    finally:
        stop([proc])


def test_strict_worker_rejects_unknown_fields_naming_them(strict_worker):
    url = strict_worker.url
    assert httpx.get(url + "/get_server_info").json()["strict_request_fields"] is True
    cases = [
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "brand_new": 1}, "brand_new"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a", "extra_key": 1}], "max_tokens": 2},
            "messages.extra_key",
        ),
        ("/generate", {"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        ("/tokenize", {"prompt": "a", "nope": True}, "nope"),
    ]
    for path, body, field in cases:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "--strict-request-fields" in err["message"], err
    ok = {"prompt": "a", "max_tokens": 2, "user": "u", "metadata": {"a": 1}, "store": False}
    r = httpx.post(url + "/v1/completions", json=ok, timeout=60)
    assert r.status_code == 200, r.text
    assert_all_healthy([strict_worker])
