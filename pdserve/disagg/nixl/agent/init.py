"""Creating a worker's NIXL agent and backend: the initialisation contract of
ARCHITECTURE.md ("NIXL backend initialisation"), written once here.

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

import json
from dataclasses import dataclass
from typing import Any

from pdserve import envs
from pdserve.disagg.base import KVArgs, Role
from pdserve.disagg.deadline import run_with_deadline
from pdserve.disagg.nixl.agent.api import NixlApi

# The backend's own name of its thread-count parameter (NIXL plugin docs).
THREAD_PARAM = {
    "UCX": "num_threads",
    "OBJ": "num_threads",
    "GDS_MT": "thread_count",
    "UCCL": "num_cpus",
}
ROLE_DEFAULT_NUM_THREADS: dict[str, int] = {Role.PREFILL: 8, Role.DECODE: 0}

_PARAMS_VAR = "PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS"


def parse_backend_params(raw: str) -> dict[str, str]:
    """Parse the backend parameters: a JSON object whose keys and values are strings.
    Anything else raises ValueError saying exactly that, naming the variable."""
    want = f"{_PARAMS_VAR} must be a JSON object of string keys to string values"
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{want}; got {raw!r}, which is not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{want}; got a JSON {type(data).__name__}: {raw!r}")
    for key, value in data.items():
        if not isinstance(value, str):
            raise ValueError(f"{want}; the value of {key!r} is a {type(value).__name__}: {value!r}")
    return data


def resolve_num_threads(role: str) -> int:
    """The agent's ``num_threads``: the env value when >= 0, else the role's default."""
    value = envs.DISAGGREGATION_NIXL_NUM_THREADS.get()
    if value < -1:
        raise ValueError(f"PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS must be >= -1, got {value}")
    return ROLE_DEFAULT_NUM_THREADS[role] if value == -1 else value


def backend_init_params(backend: str, params: dict[str, str], num_threads: int) -> dict[str, str]:
    """``params`` plus the thread count under the backend's own key, unless already set."""
    out = dict(params)
    key = THREAD_PARAM.get(backend)
    if num_threads > 0 and key is not None and key not in out:
        out[key] = str(num_threads)
    return out


@dataclass(frozen=True)
class NixlInitSpec:
    """Everything the agent is created with (read from the environment once)."""

    backend: str
    params: dict
    num_threads: int
    progress_thread: bool
    timeout_s: float

    @classmethod
    def from_env(cls, role: str) -> NixlInitSpec:
        if role not in ROLE_DEFAULT_NUM_THREADS:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        backend = envs.DISAGGREGATION_NIXL_BACKEND.get()
        if not backend:
            raise ValueError("PDSERVE_DISAGGREGATION_NIXL_BACKEND must name a NIXL plugin, got ''")
        num_threads = resolve_num_threads(role)
        params = backend_init_params(
            backend,
            parse_backend_params(envs.DISAGGREGATION_NIXL_BACKEND_PARAMS.get()),
            num_threads,
        )
        timeout = envs.DISAGGREGATION_ENGINE_INIT_TIMEOUT.get()
        if timeout <= 0:
            raise ValueError(
                f"PDSERVE_DISAGGREGATION_ENGINE_INIT_TIMEOUT must be > 0, got {timeout}"
            )
        return cls(
            backend, params, num_threads, envs.DISAGGREGATION_NIXL_PROGRESS_THREAD.get(), timeout
        )


def device_type(kv_args: KVArgs) -> str:
    """``cpu``/``cuda``/... of the resolved device in ``kv_args`` (``cuda:1`` -> ``cuda``)."""
    return kv_args.device.split(":", 1)[0]


def select_device(kv_args: KVArgs) -> None:
    """Make the worker's device current on the calling thread (no-op on CPU)."""
    kind = device_type(kv_args)
    if kind != "cpu":
        import torch

        torch.get_device_module(kind).set_device(kv_args.gpu_id)


def create_agent(
    api: NixlApi, name: str, kv_args: KVArgs, role: str, spec: NixlInitSpec | None = None
) -> tuple[Any, NixlInitSpec]:
    """Create the agent (no backend) and then its backend under the init deadline.

    Returns ``(agent, spec)``. Raises ValueError for bad parameters, ``TimeoutError``
    naming ``create_backend`` at the deadline, or NIXL's own exception object unchanged.
    """
    spec = spec or NixlInitSpec.from_env(role)
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
    return agent, spec
