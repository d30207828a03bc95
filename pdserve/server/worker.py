"""Building one worker: engine, KV transfer managers (PD roles), metrics and the app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import pdserve
from pdserve import envs, triton_watch
from pdserve.advertise import advertised_host
from pdserve.config import DisaggConfig, EngineConfig, ServerConfig
from pdserve.disagg.base import KVManager, Role
from pdserve.gc_watch import process_watch
from pdserve.server.field_policy import FieldPolicy
from pdserve.server.formatting import TokenText
from pdserve.server.metrics import ServerMetrics
from pdserve.server.openai_api import WorkerContext, max_prompt_chars
from pdserve.server.phases import PhaseMetrics, PhaseRecorder
from pdserve.server.serving import AsyncEngine, Serving
from pdserve.tracing import Tracing


def _create_managers(
    core: Any, engine_cfg: EngineConfig, disagg: DisaggConfig
) -> dict[str, KVManager]:
    from pdserve.disagg.registry import create_kv_manager
    from pdserve.disagg.transfer_config import TransferConfig

    kv_args = core.executor.kv_args(gpu_id=engine_cfg.model.gpu_id)
    transfer: KVManager
    if disagg.transfer_backend == "fake":
        transfer = create_kv_manager("fake", kv_args, disagg.role)
        return {"fake": transfer}
    # the edge: the one place a worker reads the transfer settings (flags + environment)
    cfg = TransferConfig.from_env(
        disagg.role,
        bootstrap_host=disagg.bootstrap_host,
        bootstrap_port=disagg.bootstrap_port,
        advertise_host=advertised_host(disagg.bootstrap_host, disagg.advertise_host),
    )
    if core.executor.tp_size > 1:
        from pdserve.disagg.tp import create_tp_kv_manager

        # one manager per rank, each created in its own process on its own device
        transfer = create_tp_kv_manager(
            core.executor,
            disagg.transfer_backend,
            disagg.role,
            core.executor.geometry.total_kv_heads,
            cfg,
        )
    else:
        transfer = create_kv_manager(disagg.transfer_backend, kv_args, disagg.role, cfg)
    # /health_generate goes through the fake backend
    return {
        disagg.transfer_backend: transfer,
        "fake": create_kv_manager("fake", kv_args, disagg.role),
    }


def build_worker(
    engine_cfg: EngineConfig, server_cfg: ServerConfig, disagg: DisaggConfig
) -> tuple[FastAPI, dict]:
    """Set torch's CPU thread count (``server_cfg.num_threads`` > 0), load the model, create
    the KV managers (prefill/decode roles) and return the app and its start-up info
    (``served_model_name``, ``bootstrap_port``, ``num_threads``, ...).
    Raises ValueError naming the field for a bad model/device/dtype."""
    import torch

    from pdserve.engine.core.engine import EngineCore
    from pdserve.engine.core.warmup import warm_up

    if (
        server_cfg.num_threads
    ):  # before any op runs: co-located workers must not oversubscribe cores
        torch.set_num_threads(server_cfg.num_threads)
    pd = disagg.role != Role.MIXED
    gc_watch = process_watch()
    compiles = triton_watch.process_watch()  # before the model: start-up's compiles counted
    core = EngineCore(engine_cfg, transfer_backend=disagg.transfer_backend)
    # the eager step shapes once, before /health says ready: no Triton compile in a request
    warmup = warm_up(core)
    managers: dict[str, KVManager] = {}
    ucx_log = None
    if pd and disagg.transfer_backend == "nixl":  # before UCX loads: it reads its env once
        from pdserve.disagg.nixl.agent.ucx_transports import UcxTransportLog

        ucx_log = UcxTransportLog.install(envs.UCX_LOG_DIR.get() or None)
        if ucx_log is not None:
            ucx_log.start()
    if pd:  # the managers need the pool's addresses, so they are bound after the engine is built
        managers = _create_managers(core, engine_cfg, disagg)
        core.bind_kv_managers(managers)
    transfer = managers.get(disagg.transfer_backend)
    engine = AsyncEngine(core, idle_poll_interval=server_cfg.idle_poll_interval)
    metrics = ServerMetrics(
        {
            "pdserve_engine": lambda: engine.snapshot.stats,
            "pdserve_kv_transfer": (lambda: transfer.stats()) if transfer else (lambda: None),
            "pdserve_gc": gc_watch.stats,
            "pdserve_triton": compiles.stats,
        }
    )
    model_name = server_cfg.served_model_name or engine_cfg.model.model
    layout = core.layout  # the whole model's KV heads: one page over every rank
    page_bytes = (
        2 * layout.num_layers * layout.page_size * layout.num_kv_heads * layout.head_dim
    ) * torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    phases = PhaseRecorder(
        Role(disagg.role),
        PhaseMetrics(metrics.registry),
        page_bytes=page_bytes,
        transfer_backend=disagg.transfer_backend if pd else None,
        ucx=ucx_log.snapshot if ucx_log is not None else None,
    )
    serving = Serving(
        engine,
        role=disagg.role,
        max_model_len=core.max_model_len,
        vocab_size=core.vocab_size,
        metrics=metrics,
        phases=phases,
    )
    ctx = WorkerContext(
        serving,
        core.tokenizer,
        model_name,
        TokenText(core.tokenizer),
        max_prompt_chars=max_prompt_chars(core.tokenizer, core.max_model_len),
        fields=FieldPolicy(server_cfg.strict_request_fields, metrics.ignored_fields),
        responses_store_size=server_cfg.responses_store_size,
        model_root=engine_cfg.model.model,
    )
    static = {
        "version": pdserve.__version__,
        "role": disagg.role,
        "model": engine_cfg.model.model,
        "served_model_name": model_name,
        "max_model_len": core.max_model_len,
        "strict_request_fields": server_cfg.strict_request_fields,
        "vocab_size": core.vocab_size,
        "device": str(core.device),
        "dtype": str(core.dtype).replace("torch.", ""),
        "layout": core.layout.to_dict(),
        "page_size": core.kv.page_size,
        # speculative decoding (None: off): algorithm, k, n-gram sizes or draft model
        "speculative": engine_cfg.scheduler.speculative_info(),
        "num_total_pages": core.kv.num_pages,
        "num_threads": torch.get_num_threads(),
        "tensor_parallel_size": core.executor.tp_size,
        "tp_rank_pids": core.executor.rank_pids(),
        "transfer_backend": disagg.transfer_backend if pd else None,
        "bootstrap_host": advertised_host(disagg.bootstrap_host, disagg.advertise_host)
        if disagg.role == Role.PREFILL
        else None,
        "warmup": warmup,
        "bootstrap_port": transfer.bootstrap_port
        if transfer is not None and disagg.role == Role.PREFILL
        else None,
    }

    def server_info() -> dict:
        snap = engine.snapshot
        return dict(
            static,
            num_free_pages=snap.num_free_pages,
            engine=snap.stats,
            engine_alive=engine.alive,
            engine_error=engine.error,
            transfer=transfer.stats() if transfer else None,
            ucx=ucx_log.snapshot() if ucx_log is not None else None,
            gc=gc_watch.stats(),
            triton=compiles.stats(),
        )

    from pdserve.server.app import build_worker_app

    app = build_worker_app(
        ctx,
        engine,
        metrics,
        kv_managers=managers,
        server_info=server_info,
        health_generate_timeout=server_cfg.health_generate_timeout,
        max_request_body_bytes=server_cfg.max_request_body_bytes,
        tracing=Tracing.create(server_cfg.otlp_traces_endpoint, str(disagg.role)),
    )
    if ucx_log is not None:
        _close_with_the_app(app, ucx_log.close)
    compiles.mark_started()  # a compile from here on stalls a step: logged, counted
    gc_watch.freeze()  # start-up is over: the model, tokenizer and caches live as long
    return app, static


def _close_with_the_app(app: FastAPI, close: Callable[[], None]) -> None:
    """Run ``close`` at the end of the app's lifespan. uvicorn ends its SIGINT/SIGTERM
    shutdown by raising the signal again with the default handler restored, so a SIGTERM
    kills the process without running ``atexit`` handlers: the lifespan's end (after
    "Waiting for application shutdown") is the last code that runs on a clean stop."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        try:
            async with inner(a) as state:
                yield state
        finally:
            close()

    app.router.lifespan_context = lifespan
