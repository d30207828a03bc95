"""The tensor-parallel executor (TP=N): rank 0 lives in this process and samples (the
generators, grammar masks and penalty state stay here, out of the plan); ranks ``1..N-1``
are processes it spawns (``engine/worker/rank_worker.py``), each with its model shard and KV pool
shard. Per step rank 0 stages the plan into its flat int64 buffer (``ModelRunner.stage``)
and writes the fixed header and that buffer to each rank's pipe; then every rank runs the
same forward and the same ``compute_logits`` calls (collectives over
``torch.distributed``: gloo on CPU, NCCL on CUDA), and rank 0 samples.

A rank that dies (its process sentinel fires, a collective fails on the closed connection,
or times out after ``ModelConfig.tp_timeout``, by default ``PDSERVE_TP_TIMEOUT``) turns the executor failed for good:
``failure`` names the rank, ``execute`` and ``call_rank`` raise
:class:`~pdserve.engine.worker.executor.RankFailedError`, and the engine ends its requests with
``finish_reason="error"``.  ``shutdown`` stops, joins (terminating when needed) every rank
process.  Made by :func:`pdserve.engine.worker.executor_factory.create_executor` for N > 1.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.step import BatchPlan, StepResult
from pdserve.engine.worker.executor import Executor, RankFailedError, RemoteTraceback
from pdserve.engine.worker.model_runner import HEADER_LEN, StepHeader
from pdserve.engine.worker.rank_worker import CALL, STEP, STOP, RankArgs, build_rank, rank_main
from pdserve.process_exit import death_cause

if TYPE_CHECKING:
    from pdserve.model.loader import ModelSource

logger = logging.getLogger(__name__)


# torch.distributed's C++ errors start with their source location ("[../gloo/...cc:84] ").
_SOURCE_PREFIX = re.compile(r"\[[^\]\s]+:\d+\]\s*")
_PROC_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in disk sleep"}


def _timed_out(exc: BaseException) -> bool:
    """Whether a failed collective timed out (a hung peer) rather than lost a peer."""
    return isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()


def _proc_state(pid: int) -> str | None:
    """What a rank process that does not answer is doing, when Linux says (``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return _PROC_STATES.get(f.read().rsplit(")", 1)[1].split()[0])
    except (OSError, IndexError):
        return None


class MultiprocExecutor(Executor):
    """TP=N: rank 0 here, ranks ``1..N-1`` spawned processes (see the module docstring).

    Start-up: spawn the ranks, join the group (rank 0 hosts the rendezvous store on a free
    port), build every rank; ``num_pages`` is the minimum of what each rank's memory
    allows (equal on CPU).  One TP engine per process (the group is torch.distributed's
    default one): ValueError naming ``tensor_parallel_size`` otherwise.  A rank failing to
    start raises RuntimeError naming it, after the others are stopped.
    """

    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        dtype: torch.dtype,
        attention_backend: str,
        generator: torch.Generator,
    ) -> None:
        import torch.distributed as dist

        from pdserve.engine.worker.device import resolve_rank_device
        from pdserve.model.tp_group import init_local_group, open_local_store

        mc = config.model
        n = mc.tensor_parallel_size
        if dist.is_available() and dist.is_initialized():
            raise ValueError(
                "tensor_parallel_size: this process runs a tensor-parallel engine already "
                "(one per process: its ranks use torch.distributed's default group)"
            )
        self._lock = threading.Lock()  # a step or a call at a time, in order
        self._procs: list[Any] = []  # multiprocessing.Process of ranks 1..N-1
        self._conns: list[Any] = []
        self._failure: str | None = None
        self._failure_lock = threading.Lock()
        self._closed = False
        self._sent = False
        self._group: Any = None
        self._watcher: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        timeout = self._timeout = mc.tp_timeout
        device0 = resolve_rank_device(mc, 0)
        for r in range(1, n):
            resolve_rank_device(mc, r)  # ValueError naming gpu_ids before anything starts
        store, address = open_local_store(timeout)
        self._store: Any = store  # the rendezvous store lives as long as the group
        spawn = mp.get_context("spawn")
        try:
            threads = torch.get_num_threads()
            for r in range(1, n):
                parent, child = spawn.Pipe()
                args = RankArgs(r, n, address, config, threads, timeout, os.getpid())
                proc = spawn.Process(
                    target=rank_main, args=(args, child), name=f"pdserve-tp-rank{r}", daemon=True
                )
                proc.start()
                child.close()  # ours is closed: the rank's death reads as EOF here
                self._procs.append(proc)
                self._conns.append(parent)
            for r in range(1, n):
                self._expect(r, "hello")
            self._group = init_local_group(
                0, n, address, device=device0, store=store, timeout_s=timeout
            )

            def agree(pages: int) -> int:
                decided = min([pages] + [int(self._expect(r, "num_pages")) for r in range(1, n)])
                for conn in self._conns:
                    conn.send(("num_pages", decided))
                return decided

            self.rank0 = build_rank(
                config, source, self._group, device0, dtype, attention_backend, agree, generator
            )
            for r in range(1, n):
                self._expect(r, "built")
        except BaseException:
            self.shutdown()
            raise
        self.rank0.runner.on_staged = self._send_step
        self._watcher = threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True)
        self._watcher.start()
        logger.info(
            "tensor parallel: %d ranks (pids %s), %d KV pages each",
            n,
            self.rank_pids(),
            self.rank0.storage.num_pages,
        )

    # --- start-up -------------------------------------------------------------------
    def _expect(self, rank: int, kind: str) -> Any:
        """The payload of rank ``rank``'s next start-up message, which must be ``kind``."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            proc.join(5.0)
            raise RuntimeError(
                f"tensor-parallel rank {rank} {death_cause(proc.exitcode)} during start-up"
            ) from None
        if msg[0] == "error":
            raise RuntimeError(f"tensor-parallel rank {rank}: {msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"tensor-parallel rank {rank} sent {msg[0]!r}, expected {kind!r}")
        return msg[1]

    # --- failure --------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        if self._failure is None:
            return None
        with self._failure_lock:  # logged by now (_fail)
            return self._failure

    def _rank_failure(self, rank: int) -> str:
        """What happened to rank ``rank`` (its exit and, when it said so, why)."""
        proc, conn = self._procs[rank - 1], self._conns[rank - 1]
        text = f"tensor-parallel rank {rank} (pid {proc.pid}) {death_cause(proc.exitcode)}"
        try:
            if threading.current_thread() is not self._watcher and conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    text += f": {msg[1]}"
        except (EOFError, OSError):
            pass
        return text

    def _fail(self, text: str) -> None:
        """Record why the executor cannot serve; logged once, by whoever notices first (a
        richer text for the same failure replaces it silently).  Logged under the lock that
        :meth:`_raise_if_failed` reads it under, so no step fails on a failure that is not
        logged yet (the watcher thread could set it and lose the GIL before its log line,
        while the engine thread ended the requests)."""
        with self._failure_lock:
            first = self._failure is None
            self._failure = text
            if first:
                logger.error("%s; the engine stops serving", text)

    def _watch(self) -> None:
        """Background: wait on the rank sentinels; the first to fire fails the executor."""
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs, 1)}
        ready = wait([*sentinels, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        rank = min(sentinels[s] for s in ready if s in sentinels)
        self._procs[rank - 1].join(1.0)
        if self._failure is None and not self._closed:
            self._fail(self._rank_failure(rank))

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            with self._failure_lock:  # logged by now (_fail)
                raise RankFailedError(self._failure)
        if self._closed:
            raise RankFailedError("the tensor-parallel executor is shut down")

    def _fail_from(self, exc: BaseException) -> RankFailedError:
        """A step or call failed after the ranks were involved; the group is unusable.  A
        collective that timed out names the ranks that did not answer (alive, silent: the
        peers that merely waited report their own timeout and exit); otherwise the rank
        that died (waiting briefly for its exit), else rank 0's own error."""
        deadline = time.monotonic() + 5.0
        timed_out = _timed_out(exc)
        while True:
            dead = [r for r, p in enumerate(self._procs, 1) if not p.is_alive()]
            silent = [
                r
                for r, (p, c) in enumerate(zip(self._procs, self._conns), 1)
                if p.is_alive() and not c.poll(0)
            ]
            if (dead and not timed_out) or (timed_out and not silent):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if timed_out and silent:
            text = "; ".join(self._silent_failure(r) for r in silent)
        elif dead:
            text = self._rank_failure(dead[0])
        else:
            reason = _SOURCE_PREFIX.sub("", f"{type(exc).__name__}: {exc}")
            text = f"tensor-parallel rank 0 (pid {os.getpid()}) failed mid-step: {reason}"
        self._fail(text)
        self._terminate()
        return RankFailedError(text)

    def _silent_failure(self, rank: int) -> str:
        """Rank ``rank`` is alive but did not answer a collective within the timeout."""
        pid = int(self._procs[rank - 1].pid)
        state = _proc_state(pid)
        return (
            f"tensor-parallel rank {rank} (pid {pid}) did not answer for "
            f"{self._timeout:g} s ({envs.TP_TIMEOUT.name})"
            + (f"; its process is {state}" if state else "")
        )

    # --- steps and calls ------------------------------------------------------------
    def _send_step(self, header: StepHeader, host: np.ndarray) -> None:
        """``ModelRunner.on_staged``: the step's header and flat inputs to every rank."""
        self._sent = True
        head = header.to_array(STEP)
        for conn in self._conns:
            conn.send_bytes(head)
            conn.send_bytes(host)

    def execute(self, plan: BatchPlan) -> StepResult:
        with self._lock:
            self._raise_if_failed()
            self._sent = False
            try:
                return self.rank0.runner.execute(plan)
            except Exception as exc:
                if not self._sent:  # failed before the ranks saw it: the group is in step
                    raise
                raise self._fail_from(exc) from exc

    def call_rank(self, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {rank}")
        with self._lock:
            self._raise_if_failed()
            if rank == 0:
                return fn(self.rank0, *args)
            conn = self._conns[rank - 1]
            head = np.zeros(HEADER_LEN, dtype=np.int64)
            head[0] = CALL
            try:
                conn.send_bytes(head)
                conn.send((fn, args))
                answered = conn.poll(self._timeout)  # a stopped rank must not block us
                reply = conn.recv() if answered else None
            except (EOFError, OSError) as exc:
                raise self._fail_from(exc) from exc
            if reply is None:
                text = self._silent_failure(rank)
                self._fail(text)
                self._terminate()
                raise RankFailedError(text)
        if reply[0] == "ok":
            return reply[1]
        if len(reply) == 2:  # the rank itself failed (it exits)
            raise self._fail_from(RuntimeError(reply[1]))
        raise reply[1] from RemoteTraceback(f"raised in tensor-parallel rank {rank}:\n{reply[2]}")

    def rank_pids(self) -> list[int]:
        return [os.getpid()] + [int(p.pid) for p in self._procs]

    # --- shutdown -------------------------------------------------------------------
    def _terminate(self) -> None:
        """Stop every rank process now and reap it: SIGKILL, since a rank ignores SIGTERM
        (``rank_worker.rank_main``) and a hung or stopped one would not act on it."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._watcher is not None:
            self._watcher.join(5.0)
        head = np.zeros(HEADER_LEN, dtype=np.int64)
        head[0] = STOP
        with self._lock:
            for conn in self._conns:
                try:
                    conn.send_bytes(head)
                except OSError:
                    pass
            deadline = time.monotonic() + 10.0
            for proc in self._procs:
                proc.join(max(0.1, deadline - time.monotonic()))
            self._terminate()
            for conn in self._conns:
                conn.close()
            if self._group is not None:
                from pdserve.model.tp_group import destroy_local_group

                destroy_local_group(self._group)
                self._group = None
            self._store = None
        os.close(self._wake_r)
        os.close(self._wake_w)
