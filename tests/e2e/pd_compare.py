"""Comparing a PD answer (through the router) with a mixed worker's: recursive equality
with a logprob tolerance, SSE parsing, and what a stream adds up to."""

from __future__ import annotations

import json

import httpx

from pdserve.http.wire import json_bytes

LP_TOL = 2e-4  # prefill and decode run other batch shapes than the mixed worker
IGNORED = ("id", "created", "e2e_latency", "cached_tokens")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def post(url: str, path: str, body, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def pair(c, path: str, body: dict) -> tuple[dict, dict]:
    """The same request through the router (PD, ``c["router"]``) and to the mixed worker
    (``c["mixed"]``); both must answer 200, and a generation through the router must have
    come through the prefill worker ``c["prefill"]`` (where the cluster names one): a short
    prompt under selective PD's threshold would run on decode alone, and the comparison be
    no PD's."""
    before = _prefilled(c) if path in GENERATION_PATHS else None
    pd, mixed = post(c["router"].url, path, body), post(c["mixed"].url, path, body)
    assert pd.status_code == 200, pd.text
    assert mixed.status_code == 200, mixed.text
    if before is not None:
        assert _prefilled(c) > before, "the router's answer did not go through prefill"
    for side, resp in (("router (PD)", pd), ("mixed", mixed)):  # one spelling of JSON
        assert resp.content == json_bytes(resp.json()), f"{side}: {resp.content[:200]!r}"
    return pd.json(), mixed.json()


def _prefilled(c) -> int | None:
    """Requests the cluster's prefill worker finished (None: the cluster has none)."""
    if "prefill" not in c:
        return None
    return c["prefill"].get_info()["engine"]["finished_requests"]


def assert_same(pd, mixed, path: str = "") -> None:
    """Recursive equality; floats (logprobs) within LP_TOL; ids/created/latency ignored."""
    if isinstance(pd, dict):
        assert isinstance(mixed, dict) and set(pd) == set(mixed), (
            f"{path}: keys {set(pd) ^ set(mixed)}"
        )
        for k in pd:
            if k not in IGNORED:
                assert_same(pd[k], mixed[k], f"{path}.{k}")
    elif isinstance(pd, list):
        assert isinstance(mixed, list) and len(pd) == len(mixed), (
            f"{path}: lengths {len(pd)} vs {len(mixed)}"
        )
        for i, (a, b) in enumerate(zip(pd, mixed)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(pd, float) and isinstance(mixed, float):
        assert abs(pd - mixed) <= LP_TOL, f"{path}: {pd} vs {mixed}"
    else:
        assert pd == mixed, f"{path}: {pd!r} vs {mixed!r}"


def sse(resp: httpx.Response) -> list:
    """The JSON payloads of an SSE body; asserts it ends with [DONE]."""
    assert resp.status_code == 200, resp.text
    events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", resp.text[-300:]
    docs = [json.loads(e) for e in events[:-1]]
    for event, doc in zip(events, docs):  # the router's and the worker's spelling are one
        assert event.encode() == json_bytes(doc), event[:200]
    return docs


def fold(chunks: list, path: str = "") -> dict:
    """What a stream adds up to, per sample, whatever its chunk boundaries. OpenAI
    streams: text, token ids,
    the lists of a completions ``logprobs`` object (or chat ``content`` entries),
    finish_reason, the prompt logprobs of the sample's first chunk (never in another),
    and the last usage under ``"usage"``; ``/generate`` chunks are cumulative: the last
    one per index."""
    out: dict = {}
    for chunk in chunks:
        if path == "/generate":
            out[chunk.get("index", 0)] = chunk
            continue
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for c in chunk["choices"]:
            s = out.setdefault(
                c["index"],
                {"text": "", "token_ids": [], "logprobs": {}, "finish_reason": None},
            )
            s["text"] += c["text"] if "text" in c else c["delta"].get("content", "")
            s["token_ids"] += c.get("token_ids", [])
            lp = c.get("logprobs") or {}
            for key, items in lp.items():
                s["logprobs"].setdefault(key, []).extend(items)
            s["finish_reason"] = c["finish_reason"] or s["finish_reason"]
            if "prompt_logprobs" in c:
                assert "prompt_logprobs" not in s, "prompt logprobs in a later chunk"
                s["prompt_logprobs"] = c["prompt_logprobs"]
    return out
