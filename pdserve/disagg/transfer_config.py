"""The KV transfer settings of one worker, built once where the process starts.

:class:`TransferConfig` holds every setting the transfer layer reads: where a prefill's
bootstrap server listens, the rooms' timeouts, the decode heartbeat, prefill's transfer
threads, the NIXL agent's initialisation (:class:`NixlInitSpec`) and the test-only
failure injection. :meth:`TransferConfig.from_env` reads the declared variables of
:mod:`pdserve.envs` (this is the one disagg module that does, with the doctor's
:mod:`pdserve.disagg.nixl.probe`); the edges call it (``pdserve serve``'s
``_create_managers``, ``pdserve bench transfer``, the doctor) and pass the frozen result
down ``create_kv_manager`` -> the backend's factory -> the managers (under tensor
parallelism, through ``call_rank`` to every rank). Constructors read no environment.
Every check raises ValueError naming the variable the value came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve import envs
from pdserve.disagg.base import Role, pd_role
from pdserve.ports import check_port

# The backend's own name of its thread-count parameter (NIXL plugin docs).
THREAD_PARAM = {
    "UCX": "num_threads",
    "OBJ": "num_threads",
    "GDS_MT": "thread_count",
    "UCCL": "num_cpus",
}
ROLE_DEFAULT_NUM_THREADS: dict[str, int] = {Role.PREFILL: 8, Role.DECODE: 0}


def parse_backend_params(raw: str) -> dict[str, str]:
    """Parse the backend parameters: a JSON object whose keys and values are strings.
    Anything else raises ValueError saying exactly that, naming the variable."""
    want = (
        f"{envs.DISAGGREGATION_NIXL_BACKEND_PARAMS.name} must be a JSON object of string keys "
        "to string values"
    )
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


def resolve_num_threads(role: str, value: int) -> int:
    """The agent's ``num_threads``: ``value`` when >= 0, else (-1) the role's default."""
    if value < -1:
        raise ValueError(f"{envs.DISAGGREGATION_NIXL_NUM_THREADS.name} must be >= -1, got {value}")
    return ROLE_DEFAULT_NUM_THREADS[pd_role(role)] if value == -1 else value


def backend_init_params(backend: str, params: dict[str, str], num_threads: int) -> dict[str, str]:
    """``params`` plus the thread count under the backend's own key, unless already set."""
    out = dict(params)
    key = THREAD_PARAM.get(backend)
    if num_threads > 0 and key is not None and key not in out:
        out[key] = str(num_threads)
    return out


@dataclass(frozen=True)
class NixlInitSpec:
    """Everything a NIXL agent is created with (:func:`~pdserve.disagg.nixl.agent.init.create_agent`):
    the plugin, its parameters (the thread count included), the agent's thread count,
    NIXL's progress thread, and the deadline of ``create_backend``."""

    backend: str
    params: dict[str, str]
    num_threads: int
    progress_thread: bool
    timeout_s: float

    @classmethod
    def from_env(cls, role: str) -> NixlInitSpec:
        """The spec of ``role``'s agent from the ``PDSERVE_DISAGGREGATION_NIXL_*`` and
        ``..._ENGINE_INIT_TIMEOUT`` variables. ValueError naming the variable."""
        role = pd_role(role)
        backend = envs.DISAGGREGATION_NIXL_BACKEND.get()
        if not backend:
            raise ValueError(
                f"{envs.DISAGGREGATION_NIXL_BACKEND.name} must name a NIXL plugin, got ''"
            )
        num_threads = resolve_num_threads(role, envs.DISAGGREGATION_NIXL_NUM_THREADS.get())
        params = backend_init_params(
            backend,
            parse_backend_params(envs.DISAGGREGATION_NIXL_BACKEND_PARAMS.get()),
            num_threads,
        )
        timeout = envs.DISAGGREGATION_ENGINE_INIT_TIMEOUT.get()
        if timeout <= 0:
            raise ValueError(
                f"{envs.DISAGGREGATION_ENGINE_INIT_TIMEOUT.name} must be > 0, got {timeout}"
            )
        return cls(
            backend, params, num_threads, envs.DISAGGREGATION_NIXL_PROGRESS_THREAD.get(), timeout
        )


@dataclass(frozen=True)
class BootstrapAddress:
    """Where a prefill manager's bootstrap server and control endpoint listen (``port`` 0:
    a free one, read back from ``manager.bootstrap_port``; for a TP rank >= 1: rank 0's
    server, where it registers) and the address decode peers reach them by
    (``advertise_host``; ``None``: derived from ``host``, :mod:`pdserve.advertise`).
    Decode ignores it."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        check_port(self.port, "bootstrap_port", allow_zero=True)


def planned_post() -> bool:
    """``PDSERVE_DISAGGREGATION_PLANNED_POST``: whether prefill posts a WRITE made ahead as
    planned when it was made (the default) or computes the post again at the send (the path
    before, for A/B). Read each time a prefill room is created, not once into
    :class:`TransferConfig`, so ``bench transfer --ab-env`` can run both paths in one
    process. ValueError naming the variable for a value that is not a boolean."""
    return envs.DISAGGREGATION_PLANNED_POST.get()


def _positive(var: envs.EnvVar[float] | envs.EnvVar[int], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{var.name} must be > 0, got {value}")


@dataclass(frozen=True)
class TransferConfig:
    """The transfer settings of one worker's managers (module doc). Each timing field is
    the variable named in its comment; ``agent`` is the NIXL agent's spec for the role
    the config was built for. ValueError naming the variable for a value out of range."""

    agent: NixlInitSpec
    bootstrap: BootstrapAddress = field(default_factory=BootstrapAddress)
    bootstrap_timeout_s: float = 300.0  # PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT
    waiting_timeout_s: float = 300.0  # PDSERVE_DISAGGREGATION_WAITING_TIMEOUT
    heartbeat_interval_s: float = 5.0  # PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL
    heartbeat_max_failure: int = 2  # PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
    quarantine_bound_s: float = 60.0  # PDSERVE_DISAGGREGATION_QUARANTINE_BOUND
    transfer_workers: int = 4  # PDSERVE_DISAGGREGATION_TRANSFER_WORKERS
    failure_prob: float = 0.0  # PDSERVE_TEST_DISAGG_FAILURE_PROB (testing only)

    def __post_init__(self) -> None:
        _positive(envs.DISAGGREGATION_BOOTSTRAP_TIMEOUT, self.bootstrap_timeout_s)
        _positive(envs.DISAGGREGATION_WAITING_TIMEOUT, self.waiting_timeout_s)
        _positive(envs.DISAGGREGATION_HEARTBEAT_INTERVAL, self.heartbeat_interval_s)
        _positive(envs.DISAGGREGATION_HEARTBEAT_MAX_FAILURE, self.heartbeat_max_failure)
        _positive(envs.DISAGGREGATION_QUARANTINE_BOUND, self.quarantine_bound_s)
        if self.transfer_workers < 1:
            raise ValueError(
                f"{envs.DISAGGREGATION_TRANSFER_WORKERS.name} must be >= 1, "
                f"got {self.transfer_workers}"
            )
        if not 0.0 <= self.failure_prob <= 1.0:
            raise ValueError(
                f"{envs.TEST_DISAGG_FAILURE_PROB.name} must be in [0, 1], got {self.failure_prob}"
            )

    @classmethod
    def from_env(
        cls,
        role: str,
        *,
        bootstrap_host: str = "127.0.0.1",
        bootstrap_port: int = 0,
        advertise_host: str | None = None,
    ) -> TransferConfig:
        """The config of a ``role`` worker: the bootstrap address from its flags, the rest
        from the declared variables of :mod:`pdserve.envs`. ValueError naming the
        variable (or ``bootstrap_port`` / ``role``)."""
        return cls(
            agent=NixlInitSpec.from_env(role),
            bootstrap=BootstrapAddress(bootstrap_host, bootstrap_port, advertise_host),
            bootstrap_timeout_s=envs.DISAGGREGATION_BOOTSTRAP_TIMEOUT.get(),
            waiting_timeout_s=envs.DISAGGREGATION_WAITING_TIMEOUT.get(),
            heartbeat_interval_s=envs.DISAGGREGATION_HEARTBEAT_INTERVAL.get(),
            heartbeat_max_failure=envs.DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get(),
            quarantine_bound_s=envs.DISAGGREGATION_QUARANTINE_BOUND.get(),
            transfer_workers=envs.DISAGGREGATION_TRANSFER_WORKERS.get(),
            failure_prob=envs.TEST_DISAGG_FAILURE_PROB.get(),
        )
