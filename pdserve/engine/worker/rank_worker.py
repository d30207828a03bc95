"""One tensor-parallel rank: its model shard, KV storage shard and model runner, and the loop
of a rank process (ranks ``1..N-1``; rank 0 lives in the scheduler's process).

:func:`build_rank` is the one way any rank (TP=1 included) builds what it runs: the model
(``LlamaForCausalLM(..., tp=group)``: the rank's heads, rows and vocabulary shard), its
weights, the KV storage of the rank's KV heads, CUDA graphs (TP=1 on CUDA only) and the
:class:`~pdserve.engine.worker.model_runner.ModelRunner`.  Every rank gets the same ``num_pages``:
each computes what its memory allows and ``agree_num_pages`` (rank 0: the minimum over the
ranks) decides.

A rank process (:func:`rank_main`) talks to rank 0 over one pipe
(``multiprocessing.Connection``): at start a few pickled messages (hello, its page count,
built); then per step a fixed header (``HEADER_LEN`` int64, ``staging.StepHeader`` plus
a kind) and the step's flat int64 inputs (``ModelRunner.stage``), received straight into the
rank's staging buffer; per :meth:`Executor.call_rank` one pickled ``(fn, args)`` and its
pickled result.  The model's collectives go over ``torch.distributed`` (gloo on CPU, NCCL on
CUDA), never over the pipe.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv.layout import default_page_size
from pdserve.engine.worker.cuda_graph import (
    CUDAGraphRunner,
    capture_reserve_bytes,
    verify_batch_sizes,
)
from pdserve.engine.worker.kv_storage import KVStorage, compute_num_pages, kv_bytes_per_token
from pdserve.engine.worker.model_runner import HEADER_LEN, ModelRunner, StepHeader
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.tp_group import TPGroup

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pdserve.model.loader import ModelSource

logger = logging.getLogger(__name__)

# Message kinds of a rank's pipe (header[0]).
STEP, CALL, STOP = 1, 2, 3


@dataclass
class RankContext:
    """What one rank holds; what a :meth:`Executor.call_rank` function receives.

    tp: the rank's group (``tp.rank``, ``tp.size``; collectives). device: its torch device.
    gpu_id: its CUDA device index (``ModelConfig.rank_gpu_id``; on CPU the configured index,
    as ``KVArgs.gpu_id`` carries it). storage: its KV cache bytes (its KV heads only, the
    same ``num_pages`` and aux slots on every rank; no allocator: ids are the engine
    thread's). model: its model shard. runner: its model runner.
    max_model_len: the context limit before the storage's capacity caps it.
    """

    tp: TPGroup
    device: torch.device
    gpu_id: int
    storage: KVStorage
    model: LlamaForCausalLM
    runner: ModelRunner
    max_model_len: int
    # what other layers keep in the rank between calls (disagg.tp: "kv", its KV manager)
    services: dict[str, Any] = field(default_factory=dict)


def model_max_len(config: EngineConfig, max_positions: int) -> int:
    """The context limit: ``max_model_len`` or the model's positions.  ValueError naming
    ``max_model_len`` when it exceeds the model's context."""
    max_len = config.model.max_model_len or max_positions
    if max_len > max_positions:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's context ({max_positions} positions)"
        )
    return max_len


def num_aux_slots(config: EngineConfig) -> int:
    """Aux slots of every rank's storage (and of the engine thread's ``PageIds``): twice
    ``max_running_requests``, at least 16."""
    return max(16, 2 * config.scheduler.max_running)


def build_rank(
    config: EngineConfig,
    source: ModelSource,
    tp: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    agree_num_pages: Callable[[int], int],
    generator: torch.Generator | None = None,
) -> RankContext:
    """Build rank ``tp.rank``'s model shard, weights, KV storage and runner on ``device``.

    agree_num_pages(n): given the pages this rank's memory allows, the count every rank
    uses (rank 0's choice; TP=1: ``n`` itself). generator: the shared draw of unseeded
    random rows (rank 0 only: only rank 0 samples). CUDA graphs are captured only for
    TP=1 (a graph would have to capture the collectives too; not done yet).
    Raises ValueError naming the field for a bad context limit or pool size.
    """
    page_size = config.cache.page_size or default_page_size(device)  # same on every rank
    mc, sc = config.model, config.scheduler
    shard = {"tp": tp} if tp.size > 1 else {}  # TP=1: the unsharded model, no group at all
    model = LlamaForCausalLM(
        source.hf_config,
        dtype=dtype,
        device=device,
        attn_backend=attention_backend,
        quantization=mc.quantization,
        **shard,
    )
    # A rank reads only its slice of each tensor (safetensors: from disk); TP=1 all of it.
    model.load_weights(source.weights(shard=model.weight_shard) if shard else source.weights())
    shapes = model.shapes
    fp8_kv = config.cache.kv_cache_dtype == "fp8_e4m3"
    kv_dtype = torch.float8_e4m3fn if fp8_kv else dtype
    max_len = model_max_len(config, shapes.max_positions)
    use_graphs = (
        tp.size == 1
        and device.type == "cuda"
        and not mc.enforce_eager
        and model.backend.supports_cuda_graphs
    )
    # The graphs' memory is held back while the KV storage is sized from free memory, then
    # released for the capture (which needs the storage's address), so capture cannot OOM.
    reserve = (
        torch.empty(
            capture_reserve_bytes(model, sc.max_running, _verify_tokens(config)),
            dtype=torch.uint8,
            device=device,
        )
        if use_graphs
        else None
    )
    num_pages = compute_num_pages(
        config.cache,
        num_layers=shapes.n_layers,
        num_kv_heads=shapes.n_kv_heads,  # this rank's KV heads
        head_dim=shapes.head_dim,
        dtype=kv_dtype,
        device=device,
        max_running_requests=sc.max_running,
        max_model_len=max_len,
        extra_bytes_per_token=draft_kv_bytes_per_token(config, dtype),
    )
    num_pages = agree_num_pages(num_pages)
    storage = KVStorage(
        num_layers=shapes.n_layers,
        num_kv_heads=shapes.n_kv_heads,
        head_dim=shapes.head_dim,
        dtype=kv_dtype,
        device=device,
        page_size=page_size,
        num_pages=num_pages,
        num_aux_slots=num_aux_slots(config),
        model_fingerprint=source.fingerprint,
        kv_order=config.cache.kv_order,
        speculative=config.scheduler.speculative_key(),
        kv_scales=model.kv_scales if fp8_kv else None,
    )
    graphs = None
    if use_graphs:
        del reserve
        torch.cuda.empty_cache()
        graphs = CUDAGraphRunner(
            model,
            storage.layer_caches,
            page_size,
            sc.max_running,
            CUDAGraphRunner.max_pages_for(min(max_len, num_pages * page_size), page_size),
        )
        graphs.capture()  # before any transfer thread starts (bind_kv_managers is later)
        if sc.speculative_algorithm is not None and sc.num_speculative_tokens > 0:
            graphs.capture_verify(sc.num_speculative_tokens)
    runner = ModelRunner(model, storage, device, generator, graphs)
    gpu_id = device.index if device.index is not None else mc.rank_gpu_id(tp.rank)
    return RankContext(tp, device, gpu_id, storage, model, runner, max_len)


def draft_kv_bytes_per_token(config: EngineConfig, dtype: torch.dtype) -> int:
    """KV bytes per token (all layers, ``dtype``) of ``config``'s speculative draft model,
    0 without one.  The draft model's pool has as many pages as the target's
    (``engine/spec/factory.py``), so the target's pool is sized with these bytes counted
    in: one ``--kv-cache-memory`` (or ``gpu_memory_utilization``) budget split between the
    two by their bytes per token.  Reads the draft's config only (no weights)."""
    sc = config.scheduler
    if sc.speculative_algorithm != "draft" or sc.speculative_model is None:
        return 0
    from pdserve.model.loader import model_config
    from pdserve.model.shapes import ModelShapes

    s = ModelShapes(model_config(sc.speculative_model))
    return kv_bytes_per_token(s.n_layers, s.n_kv_heads, s.head_dim, dtype)


def _verify_tokens(config: EngineConfig) -> int:
    """Tokens of the largest verify graph ``config`` captures at start (0: none)."""
    sc = config.scheduler
    if sc.speculative_algorithm is None or sc.num_speculative_tokens < 1:
        return 0
    q = sc.num_speculative_tokens + 1
    return verify_batch_sizes(sc.max_running, q)[-1] * q


def prepare_verify_graphs(ctx: RankContext, num_speculative_tokens: int) -> None:
    """Capture the verify graphs of ``num_speculative_tokens`` drafts a row on this rank
    (``CUDAGraphRunner.capture_verify``; once per engine, a no-op without graphs).  Run it
    between steps through ``Executor.call_rank`` with no KV transfer in flight.
    ValueError naming ``num_speculative_tokens`` when graphs were made for another k."""
    graphs = ctx.runner.graphs
    if graphs is not None:
        graphs.capture_verify(num_speculative_tokens)


@dataclass(frozen=True)
class RankArgs:
    """What a rank process is started with (pickled once, by the spawn).

    rank/size: its place in the group. store_address: ``host:port`` of rank 0's rendezvous
    store. config: the engine's config. num_threads: torch CPU threads (rank 0's count).
    timeout_s: rendezvous and collective timeout. parent_pid: rank 0's process (the rank
    exits when it is gone).
    """

    rank: int
    size: int
    store_address: str
    config: EngineConfig
    num_threads: int
    timeout_s: float
    parent_pid: int


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as rank 0's process is gone (no stray ranks)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=loop, name="pdserve-tp-parent-watch", daemon=True).start()


def rank_main(args: RankArgs, conn: Connection) -> None:
    """Entry point of rank ``args.rank``'s process: join the group, build the rank, serve
    steps and calls from rank 0 until STOP or a closed pipe.  Any failure is reported on the
    pipe (``("error", text)``) before the process exits with status 1.  SIGINT and SIGTERM
    are ignored: rank 0 stops the rank (STOP, or SIGKILL), and the rank exits by itself
    when rank 0's process is gone."""
    from pdserve.engine.worker.device import resolve_dtype, resolve_rank_device
    from pdserve.model.attention import default_backend
    from pdserve.model.loader import load_model_source
    from pdserve.model.tp_group import init_local_group

    # Ctrl-C and `kill` of the process group reach rank 0's process too, which stops its
    # ranks itself (STOP, then SIGKILL): a rank dying of them first would read as a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_parent(args.parent_pid)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    conn.send(("hello", os.getpid()))
    try:
        mc = args.config.model
        device = resolve_rank_device(mc, args.rank)
        dtype = resolve_dtype(mc.dtype, device)
        tp = init_local_group(
            args.rank, args.size, args.store_address, device=device, timeout_s=args.timeout_s
        )
        source = load_model_source(mc.model, seed=mc.seed)
        backend = (
            default_backend(device) if mc.attention_backend == "auto" else mc.attention_backend
        )

        def agree(n: int) -> int:
            conn.send(("num_pages", n))
            kind, decided = conn.recv()
            assert kind == "num_pages", kind
            return int(decided)

        with torch.inference_mode():
            ctx = build_rank(args.config, source, tp, device, dtype, backend, agree)
        conn.send(("built", ctx.storage.num_pages))
    except BaseException as exc:  # noqa: BLE001 reported to rank 0, then this rank exits
        _report_and_exit(conn, f"start-up failed: {type(exc).__name__}: {exc}")
    try:
        serve_rank(ctx, conn)
    except (EOFError, OSError):
        os._exit(0)  # rank 0 is gone: nothing to report to
    except BaseException as exc:  # noqa: BLE001
        _report_and_exit(conn, f"{type(exc).__name__}: {exc}")


def _report_and_exit(conn: Connection, text: str) -> None:
    traceback.print_exc(file=sys.stderr)
    try:
        conn.send(("error", text))
    except OSError:
        pass
    sys.stderr.flush()
    os._exit(1)  # no atexit handlers: a torch.distributed teardown could wait for peers


@torch.inference_mode()
def serve_rank(ctx: RankContext, conn: Connection) -> None:
    """The rank's loop: per message, run the step's forward and logits (the collectives
    every rank makes), or run a call and send its result; return on STOP."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    while True:
        conn.recv_bytes_into(header)
        kind = int(header[0])
        if kind == STEP:
            step = StepHeader.from_array(header)
            host = ctx.runner.staging_view(step.total)
            conn.recv_bytes_into(host)
            ctx.runner.run_staged(step, host)  # logits are rank 0's to sample
        elif kind == CALL:
            fn, fn_args = conn.recv()
            reply = run_call(ctx, fn, fn_args)
            try:
                conn.send(reply)  # pickled whole before a byte is written
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                name = getattr(fn, "__name__", repr(fn))
                conn.send(("error", RuntimeError(f"{name}'s result does not pickle: {exc}"), ""))
        elif kind == STOP:
            return
        else:
            raise RuntimeError(f"unknown message kind {kind} from rank 0")


def run_call(ctx: RankContext, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``("ok", fn(ctx, *args))`` or ``("error", exception, traceback text)`` (the exception
    replaced by a RuntimeError carrying its text when it does not pickle)."""
    try:
        return ("ok", fn(ctx, *args))
    except Exception as exc:  # noqa: BLE001 re-raised on the caller's side
        tb = traceback.format_exc()
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        return ("error", exc, tb)
