"""Two engines over the package's fake KV backend (pdserve/disagg/fake.py), for the tests of
the engine's disaggregation hooks (tests/engine/test_disagg_*.py): the pair and its
managers, a request's disagg info, stepping engines until idle, and the check that every
room was closed once after a terminal poll (the fixtures pd_cores and pd_clean:
tests/engine/conftest.py)."""

from __future__ import annotations

import itertools

from pdserve.disagg.fake import TERMINAL, FakeKVManager, link
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.request import DisaggRequestInfo

PROMPT = list(range(300, 322))  # 22 tokens = 6 pages of 4
rooms = itertools.count(1000)


def pd_pair(cfg):
    """(prefill engine, decode engine, managers): "p"/"d" a loopback pair bound as
    ``nixl``, "pm"/"dm" scripted managers bound as ``fake`` (the managers need the
    engines' pools, so they are bound after construction)."""
    prefill, decode = EngineCore(cfg), EngineCore(cfg)
    m = {}
    for core, role, key in ((prefill, "prefill", "p"), (decode, "decode", "d")):
        m[key] = FakeKVManager(core.executor.kv_args(), role)
        m[key + "m"] = FakeKVManager(core.executor.kv_args(), role, scripted=True)
        core.bind_kv_managers({"nixl": m[key], "fake": m[key + "m"]})
    link(m["p"], m["d"])
    return prefill, decode, m


def assert_closed_once_after_terminal(managers, before=frozenset()):
    """Every room (but those of ``before``, ids of handles seen earlier) was closed exactly
    once, after a terminal poll (or after an abort that followed a poll that raised: the
    engine counts that as terminal)."""
    for mgr in managers:
        for h in mgr.handles():
            if id(h) in before:
                continue
            assert len(h.closes) == 1, (h.room, h.closes)
            assert h.closes[0] in TERMINAL or (h.aborted and "poll" in h.raised), h.room


def info(role, room, fake=False):
    return DisaggRequestInfo(
        role=role, bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=room, fake=fake
    )


def drive(*cores, max_steps=200):
    """Step every engine until all are idle; returns the final output of each request id."""
    final = {}
    for _ in range(max_steps):
        for core in cores:
            for out in core.step():
                if out.finished:
                    final[out.request_id] = out
        if not any(c.has_unfinished_requests() for c in cores):
            return final
    raise AssertionError("engines did not become idle")
