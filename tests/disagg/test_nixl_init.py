"""NIXL initialisation contract (ARCHITECTURE.md) with the NIXL agent faked and every
background thread stubbed: device selection and create_backend on one helper thread,
thread-count parameters per role/backend, the init deadline, parameter parsing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.disagg import registry
from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs, KVLayout, ServiceThreads
from pdserve.disagg.nixl import factory
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.prefill.manager import NixlPrefillManager
from pdserve.disagg.transfer_config import (
    TransferConfig,
    backend_init_params,
    parse_backend_params,
)

ENV = (
    "PDSERVE_DISAGGREGATION_NIXL_BACKEND",
    "PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS",
    "PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS",
    "PDSERVE_DISAGGREGATION_ENGINE_INIT_TIMEOUT",
)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.on_create = None  # callable run inside create_backend

    def add(self, *call) -> None:
        self.calls.append(call + (threading.get_ident(),))


def make_api(rec: Recorder) -> NixlApi:
    class Sync:
        NIXL_THREAD_SYNC_STRICT = "STRICT"

    class Config:
        def __init__(self, **kw) -> None:
            self.kw = kw

    class Dlist:
        def release(self) -> None:
            pass

    class Agent:
        def __init__(self, name, config) -> None:
            rec.add("agent", name, config.kw)

        def create_backend(self, name, params) -> None:
            rec.add("create_backend", name, dict(params))
            if rec.on_create:
                rec.on_create()

        def register_memory(self, regs, mem):
            rec.add("register_memory", mem, [r[2] for r in regs])
            return object()

        def deregister_memory(self, reg) -> None:
            pass

        def prep_xfer_dlist(self, agent_name, rows, mem):
            return Dlist()

        def get_agent_metadata(self) -> bytes:
            return b"metadata"

    return NixlApi(Agent, Config, Sync, "fake")


@pytest.fixture
def rec(monkeypatch):
    """A fake NIXL, a fake CUDA device module, and no background thread at all."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    r = Recorder()
    monkeypatch.setattr(factory, "load_nixl_api", lambda: make_api(r))

    class DeviceModule:
        def __init__(self, kind) -> None:
            self.kind = kind

        def set_device(self, index) -> None:
            r.add("set_device", self.kind, index)

    monkeypatch.setattr(torch, "get_device_module", lambda kind: DeviceModule(str(kind)))
    monkeypatch.setattr(
        ServiceThreads, "start", lambda self, name, loop: r.add("thread stubbed", name)
    )
    monkeypatch.setattr(NixlPrefillManager, "_start", lambda self: r.add("prefill start stubbed"))
    return r


def kv_args(device: str, gpu_id: int) -> KVArgs:
    kv = np.zeros((4, 2, 8, 64), dtype=np.uint8)  # stands for device memory; never touched
    aux = np.zeros((4, AUX_RECORD_BYTES), dtype=np.uint8)
    kv_args.keep = (kv, aux)
    return KVArgs(
        tuple(kv[l, s].ctypes.data for l in range(4) for s in range(2)),
        (8 * 64,) * 8,
        (64,) * 8,
        aux.ctypes.data,
        aux.nbytes,
        AUX_RECORD_BYTES,
        KVLayout("m", "float32", 4, 4, 2, 8),
        device=device,
        gpu_id=gpu_id,
    )


def create(role: str, device: str = "cuda", gpu_id: int = 0):
    """A manager as a worker makes one: its settings read from the environment first."""
    cfg = TransferConfig.from_env(role)
    return registry.create_kv_manager("nixl", kv_args(device, gpu_id), role, cfg)


def device_calls(rec: Recorder) -> list[tuple]:
    return [c for c in rec.calls if c[0] in ("set_device", "create_backend")]


@pytest.mark.parametrize(
    "role,gpu_id,params,threads", [("prefill", 3, {"num_threads": "8"}, 8), ("decode", 1, {}, 0)]
)
def test_set_device_then_create_backend_on_one_helper_thread(rec, role, gpu_id, params, threads):
    assert ModelConfig().device == "auto"  # the user's --device is unset; the runtime resolved cuda
    caller = threading.get_ident()
    # an earlier test's thread may still be ending (a loaded machine): only new ones count
    earlier = set(threading.enumerate())
    mgr = create(role, "cuda", gpu_id)
    try:
        calls = device_calls(rec)
        # prefill has a second agent, the notifier: same device, no worker threads
        notifier = [("set_device", "cuda", gpu_id), ("create_backend", "UCX", {})]
        assert [c[:-1] for c in calls] == [
            ("set_device", "cuda", gpu_id),
            ("create_backend", "UCX", params),
        ] + (notifier if role == "prefill" else [])
        assert calls[0][-1] == calls[1][-1] != caller
        agents = [c for c in rec.calls if c[0] == "agent"]
        assert agents[0][2]["backends"] == [] and agents[0][2]["num_threads"] == threads
        assert all(a[2]["sync_mode"] == "STRICT" for a in agents)
        assert [a[2]["num_threads"] for a in agents[1:]] == ([0] if role == "prefill" else [])
        assert ("register_memory", "VRAM", [gpu_id] * 8) == next(
            c for c in rec.calls if c[0] == "register_memory"
        )[:-1]
        assert not any(
            t.name.startswith("pdserve-") for t in set(threading.enumerate()) - earlier
        )  # threads stubbed
    finally:
        mgr.shutdown()


def test_cpu_creates_backend_on_helper_thread_without_selecting_a_device(rec):
    mgr = create("prefill", "cpu", 5)
    mgr.shutdown()
    calls = device_calls(rec)
    assert [c[:-1] for c in calls] == [
        ("create_backend", "UCX", {"num_threads": "8"}),
        ("create_backend", "UCX", {}),  # the notifier agent
    ]
    assert calls[0][-1] != threading.get_ident()


def test_user_thread_param_wins_and_env_thread_count(rec, monkeypatch):
    monkeypatch.setenv(
        "PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS", '{"num_threads": "2", "x": "y"}'
    )
    create("prefill").shutdown()
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS", "{}")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS", "3")
    create("decode").shutdown()
    created = [c[2] for c in rec.calls if c[0] == "create_backend"]
    # prefill's notifier agent keeps the user's other params, never worker threads
    assert created == [{"num_threads": "2", "x": "y"}, {"x": "y"}, {"num_threads": "3"}]


@pytest.mark.parametrize(
    "backend,expected",
    [
        ("UCX", {"num_threads": "8"}),
        ("OBJ", {"num_threads": "8"}),
        ("GDS_MT", {"thread_count": "8"}),
        ("UCCL", {"num_cpus": "8"}),
        ("POSIX", {}),
    ],
)
def test_thread_param_name_per_backend(backend, expected):
    assert backend_init_params(backend, {}, 8) == expected
    assert backend_init_params(backend, {}, 0) == {}


def test_create_backend_exception_reaches_caller_as_the_same_object(rec):
    boom = RuntimeError("NIXL_ERR_BACKEND")

    def fail():
        raise boom

    rec.on_create = fail
    with pytest.raises(RuntimeError) as info:
        create("prefill")
    assert info.value is boom


@pytest.mark.timeout(30)
def test_create_backend_hang_raises_timeout_naming_the_call(rec, monkeypatch):
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_ENGINE_INIT_TIMEOUT", "0.3")
    release = threading.Event()
    rec.on_create = release.wait
    t0 = time.monotonic()
    try:
        with pytest.raises(
            TimeoutError, match=r"NIXL create_backend\('UCX'\) on the decode worker"
        ):
            create("decode", "cuda", 1)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
        for t in threading.enumerate():
            if t.name.startswith("deadline:"):
                t.join(5)


@pytest.mark.parametrize(
    "raw,what",
    [
        ("num_threads=8", "not JSON"),
        ('["a", "b"]', "JSON list"),
        ('{"num_threads": 8}', "value of 'num_threads' is a int"),
        ('"UCX"', "JSON str"),
    ],
)
def test_malformed_backend_params_are_a_value_error(rec, monkeypatch, raw, what):
    with pytest.raises(
        ValueError, match="must be a JSON object of string keys to string values"
    ) as info:
        parse_backend_params(raw)
    assert what in str(info.value)
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS", raw)
    with pytest.raises(ValueError, match="PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS"):
        create("prefill")
    assert device_calls(rec) == []  # nothing was created


class _RankStorage:
    """A rank's KV storage as ``start_rank_manager`` sees it: KVArgs on its own CUDA device."""

    def __init__(self, gpu_id: int) -> None:
        self.gpu_id = gpu_id

    def kv_args(self, gpu_id, engine_rank, tp_size, total_kv_heads):
        from dataclasses import replace

        args = kv_args("cuda", gpu_id)
        layout = replace(args.layout, num_kv_heads=total_kv_heads)
        return replace(args, layout=layout, engine_rank=engine_rank, tp_size=tp_size)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_tp_rank_creates_its_backend_on_its_own_gpu_on_a_helper_thread(rec, role):
    """The seed's init contract per rank (each rank's process calls ``start_rank_manager``
    with its context): set_device(that rank's gpu_id) then create_backend, on one helper
    thread that is not the caller's; its memory registered as VRAM of that device."""
    from types import SimpleNamespace

    from pdserve.disagg.tp import start_rank_manager
    from pdserve.parallel import TPRank

    caller = threading.get_ident()
    size, first_gpu = 4, 2
    managers = []
    try:
        for r in range(size):
            rec.calls.clear()
            ctx = SimpleNamespace(
                tp=SimpleNamespace(tp=TPRank(r, size)),
                gpu_id=first_gpu + r,
                storage=_RankStorage(first_gpu + r),
                services={},
            )
            port = 0 if r == 0 else 4321  # ranks >= 1 register at rank 0's server
            cfg = TransferConfig.from_env(role, bootstrap_port=port)
            start_rank_manager(ctx, "nixl", role, 2, cfg)
            managers.append(ctx.services["kv"].manager)
            calls = device_calls(rec)
            notifier = [("set_device", "cuda", first_gpu + r), ("create_backend", "UCX", {})]
            assert [c[:-1] for c in calls] == [
                ("set_device", "cuda", first_gpu + r),
                ("create_backend", "UCX", {"num_threads": "8"} if role == "prefill" else {}),
            ] + (notifier if role == "prefill" else []), r
            assert calls[0][-1] == calls[1][-1] != caller
            reg = next(c for c in rec.calls if c[0] == "register_memory")
            assert reg[1:-1] == ("VRAM", [first_gpu + r] * 8)
            assert managers[-1].engine.kv_args.tp == TPRank(r, size)
    finally:
        for m in managers:
            m.shutdown()
