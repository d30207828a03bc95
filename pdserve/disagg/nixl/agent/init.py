"""Creating a worker's NIXL agent and backend: the initialisation contract of
ARCHITECTURE.md ("NIXL backend initialisation"), written once here (the settings come in
a :class:`~pdserve.disagg.transfer_config.NixlInitSpec`, read from these variables at
the process edge).

- backend name ``PDSERVE_DISAGGREGATION_NIXL_BACKEND`` (default ``UCX``), parameters
  ``PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS`` (JSON object of string -> string);
- agent with ``backends=[]``, ``num_threads`` (prefill 8, decode 0, or
  ``PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS``), ``sync_mode=NIXL_THREAD_SYNC_STRICT`` since
  transfer workers, the control thread and the bootstrap thread use the agent at once;
- the thread count goes to the backend as its own parameter unless the user set it;
- ``create_backend`` runs under :func:`run_with_deadline`; the callback first selects the
  worker's device on the helper thread (the current device is thread-local) and then
  creates the backend. The device is the one the runtime resolved (``KVArgs.device``, set
  from the KV pool's tensor), never the user's possibly unset ``--device``. On CPU there is
  no current device to select (``torch.cpu.set_device`` is a no-op), so only
  ``create_backend`` runs.
"""

from __future__ import annotations

from typing import Any

from pdserve.disagg.base import KVArgs
from pdserve.disagg.deadline import run_with_deadline
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.transfer_config import NixlInitSpec


def as_str(name: Any) -> str:
    """An agent name as NIXL returns it (``str`` or ``bytes``), as ``str``."""
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def device_type(kv_args: KVArgs) -> str:
    """``cpu``/``cuda``/... of the resolved device in ``kv_args`` (``cuda:1`` -> ``cuda``)."""
    return kv_args.device.split(":", 1)[0]


def select_device(kv_args: KVArgs) -> None:
    """Make the worker's device current on the calling thread (no-op on CPU)."""
    kind = device_type(kv_args)
    if kind != "cpu":
        import torch

        torch.get_device_module(kind).set_device(kv_args.gpu_id)


def create_agent(api: NixlApi, name: str, kv_args: KVArgs, role: str, spec: NixlInitSpec) -> Any:
    """Create the agent (no backend) and then its backend under the init deadline, as
    ``spec`` says (:class:`~pdserve.disagg.transfer_config.NixlInitSpec`, built at the
    process edge).

    Returns the agent. Raises ``TimeoutError`` naming ``create_backend`` at the deadline,
    or NIXL's own exception object unchanged.
    """
    config = api.nixl_agent_config(
        enable_prog_thread=spec.progress_thread,
        enable_listen_thread=False,
        backends=[],
        num_threads=spec.num_threads,
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = api.nixl_agent(name, config)

    def create_backend() -> None:
        select_device(kv_args)
        agent.create_backend(spec.backend, spec.params)

    run_with_deadline(
        create_backend,
        spec.timeout_s,
        f"NIXL create_backend({spec.backend!r}) on the {role} worker",
    )
    return agent
