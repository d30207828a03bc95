"""The model's view of a tensor-parallel group: its rank and two collectives.

``TPGroup`` is what :class:`pdserve.model.llama.LlamaForCausalLM` takes as ``tp``: the rank's
:class:`pdserve.parallel.TPRank` plus ``all_reduce_`` (row-parallel outputs, the
vocab-parallel embedding) and ``all_gather`` (the vocab-sharded LM head's logits). A group
of size 1 (``TPGroup.single()``) never touches ``torch.distributed``; larger ones wrap an
initialised process group (gloo on CPU, NCCL on CUDA).

Local groups (every rank a process of one host; tests and the engine's rank workers): the
parent opens a rendezvous store on a free port (``open_local_store``: the OS picks the
port, so nothing is fixed and nothing races), hands its address to every rank, and each
rank calls ``init_local_group(rank, size, address)``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pdserve.parallel import TPRank

DEFAULT_TIMEOUT_S = 120.0  # collectives and rendezvous; a dead peer fails a rank after this


class TPGroup:
    """A tensor-parallel group as the model uses it.

    tp: this rank's ``TPRank(rank, size)``. group: the ``torch.distributed`` process group
    (``None`` = the default group; unused when ``tp.size == 1``). backend: ``"gloo"`` or
    ``"nccl"`` (for information), ``None`` when single.
    Build with :meth:`single` or :meth:`from_torch_distributed`.
    """

    def __init__(self, tp: TPRank, group: Any = None, backend: str | None = None) -> None:
        self.tp = tp
        self.group = group
        self.backend = backend

    @classmethod
    def single(cls) -> TPGroup:
        """The size-1 group: collectives are no-ops, ``torch.distributed`` is never used."""
        return cls(TPRank(0, 1))

    @classmethod
    def from_torch_distributed(cls, group: Any = None) -> TPGroup:
        """Wrap an initialised process group (``None``: the default one).

        Raises ``RuntimeError`` when ``torch.distributed`` is not initialised.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised (call init_local_group or "
                "torch.distributed.init_process_group first)"
            )
        tp = TPRank(dist.get_rank(group), dist.get_world_size(group))
        return cls(tp, group, str(dist.get_backend(group)))

    @property
    def rank(self) -> int:
        """This rank, in ``[0, size)``."""
        return self.tp.rank

    @property
    def size(self) -> int:
        """The number of ranks (``tensor_parallel_size``)."""
        return self.tp.size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (any shape, float dtype, contiguous) over the ranks in place; returns ``t``.

        A collective: every rank calls it with a tensor of the same shape and dtype.
        """
        if self.tp.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` in rank order (a new tensor; ``t``
        itself when single). Every rank passes the same shape: ``[..., n, ...]`` ->
        ``[..., size * n, ...]``. A collective."""
        if self.tp.size == 1:
            return t
        t = t.contiguous()
        size = self.tp.size
        out = t.new_empty((size * t.shape[0], *t.shape[1:]))  # rank-major along dim 0
        # One buffer, one call (gloo and NCCL); all_gather_single is newer torch's name of
        # all_gather_into_tensor (which it deprecates).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, t, group=self.group)
        if dim % t.dim() == 0:
            return out
        return torch.cat(out.chunk(size, dim=0), dim=dim)

    def barrier(self) -> None:
        """Wait for every rank (no-op when single)."""
        if self.tp.size > 1:
            dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.tp.rank}, size={self.tp.size}, backend={self.backend})"


def open_local_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, str]:
    """Open a rendezvous store on ``127.0.0.1`` at a port the OS picks; returns ``(store,
    "127.0.0.1:<port>")``. The caller keeps ``store`` alive as long as the group lives (a
    rank in this process passes it to :func:`init_local_group` as ``store``)."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, f"127.0.0.1:{store.port}"


def init_local_group(
    rank: int,
    size: int,
    address: str,
    *,
    device: torch.device | str = "cpu",
    store: dist.Store | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the default process group of ``size`` local ranks as ``rank``; returns its TPGroup.

    address: ``"host:port"`` from :func:`open_local_store` (ignored when ``store`` is given,
    e.g. in the process that opened it). device: ``cpu`` -> gloo; ``cuda:i`` -> NCCL (the
    current CUDA device is set to ``i`` first). timeout_s: rendezvous and collective timeout
    (a dead peer makes the surviving ranks' collectives raise after it). Size 1 returns
    :meth:`TPGroup.single` without initialising anything. Raises ``ValueError`` naming
    ``tp_rank`` / ``tensor_parallel_size`` when out of range; ``torch.distributed`` errors
    (``DistStoreError`` on a rendezvous timeout) otherwise.
    """
    TPRank(rank, size)  # validates
    if size == 1:
        return TPGroup.single()
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.index is not None:
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPGroup.from_torch_distributed()


def destroy_local_group(group: TPGroup) -> None:
    """Tear down what :func:`init_local_group` set up (no-op for a single group)."""
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
