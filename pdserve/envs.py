"""Every environment variable pdserve reads, declared once, typed, with its default.

Read a value with ``envs.NAME.get()``; the value is parsed on each call so tests can
set the variable with ``monkeypatch.setenv``. ``pdserve --help-env`` and the table in
docs/reference.md are generated from :data:`ALL`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {raw!r}")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, parser, default and meaning.

    ``get()`` returns the parsed value, or ``default`` when the variable is unset.
    Raises ``ValueError`` naming the variable when the value does not parse.
    """

    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from exc

    def is_set(self) -> bool:
        return self.name in os.environ


# --- disaggregation / NIXL -------------------------------------------------------
DISAGGREGATION_NIXL_BACKEND = EnvVar(
    "PDSERVE_DISAGGREGATION_NIXL_BACKEND",
    str,
    "UCX",
    "NIXL backend plugin used for KV transfer (UCX, POSIX, GDS_MT, ...).",
)
DISAGGREGATION_NIXL_BACKEND_PARAMS = EnvVar(
    "PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS",
    str,
    "{}",
    "JSON object of string -> string passed to NIXL create_backend; anything else is a ValueError.",
)
DISAGGREGATION_ENGINE_INIT_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_ENGINE_INIT_TIMEOUT",
    float,
    60.0,
    "Seconds allowed for NIXL create_backend before start-up fails with TimeoutError.",
)
DISAGGREGATION_BOOTSTRAP_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    float,
    300.0,
    "Seconds a prefill room waits for decode's destination info before it fails.",
)
DISAGGREGATION_WAITING_TIMEOUT = EnvVar(
    "PDSERVE_DISAGGREGATION_WAITING_TIMEOUT",
    float,
    300.0,
    "Seconds a decode room waits for its KV cache to arrive before it fails.",
)
DISAGGREGATION_HEARTBEAT_INTERVAL = EnvVar(
    "PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL",
    float,
    5.0,
    "Seconds between decode's heartbeats to each prefill peer it has rooms with.",
)
DISAGGREGATION_HEARTBEAT_MAX_FAILURE = EnvVar(
    "PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
    int,
    2,
    "Consecutive missed heartbeats after which every room of that prefill peer fails.",
)
DISAGGREGATION_QUARANTINE_BOUND = EnvVar(
    "PDSERVE_DISAGGREGATION_QUARANTINE_BOUND",
    float,
    60.0,
    "Seconds after which decode pages quarantined for a prefill peer (declared dead but "
    "not known gone, so it may still WRITE) mark that peer unhealthy in /get_server_info "
    "and the metrics; the router then pairs that decode with other prefills (503 when no "
    "pair is left). The pages stay quarantined: they are never freed on a timeout.",
)
DISAGGREGATION_NIXL_NUM_THREADS = EnvVar(
    "PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS",
    int,
    -1,
    "NIXL agent num_threads; -1 means the role default (prefill 8, decode 0).",
)
DISAGGREGATION_TRANSFER_WORKERS = EnvVar(
    "PDSERVE_DISAGGREGATION_TRANSFER_WORKERS",
    int,
    4,
    "Transfer worker threads on a prefill worker that post NIXL WRITEs.",
)
DISAGGREGATION_NIXL_PROGRESS_THREAD = EnvVar(
    "PDSERVE_DISAGGREGATION_NIXL_PROGRESS_THREAD",
    _parse_bool,
    False,
    "Enable NIXL's progress thread (off: on few cores it competes with the polling threads).",
)
DISAGGREGATION_PLANNED_POST = EnvVar(
    "PDSERVE_DISAGGREGATION_PLANNED_POST",
    _parse_bool,
    True,
    "Prefill: a WRITE made ahead (expect_pages) is posted as planned when it was made (index "
    "arrays, inline or queued, handles in order), nothing computed again at the send; 0: "
    "the send computes them as for any other (the path before session 15, for A/B). Read "
    "when a room is created.",
)
UCX_LOG_DIR = EnvVar(
    "PDSERVE_UCX_LOG_DIR",
    str,
    "",
    "Folder of a PD worker's UCX protocol report, pdserve-ucx-<pid>.log (deleted when the "
    "worker stops cleanly); empty: the system's temporary folder. `pdserve up` sets it to "
    "its log folder.",
)
TEST_DISAGG_FAILURE_PROB = EnvVar(
    "PDSERVE_TEST_DISAGG_FAILURE_PROB",
    float,
    0.0,
    "Testing only: probability that a KVSender/KVReceiver poll reports Failed (injected).",
)

# --- models ------------------------------------------------------------------------
CACHE_DIR = EnvVar(
    "PDSERVE_CACHE_DIR",
    str,
    os.path.join(os.path.expanduser("~"), ".cache", "pdserve"),
    "Where converted model copies (e.g. the embedded GGUF as safetensors) are cached.",
)


TRITON_PDL = EnvVar(
    "PDSERVE_TRITON_PDL",
    _parse_bool,
    True,
    "Launch our Triton kernels with programmatic dependent launch on CUDA sm_90+ (each "
    "waits for its predecessor in-kernel, so its launch overlaps the predecessor's tail). "
    "On by default (the H200's decode step measured faster with it, docs/benchmarks.md); "
    "0 turns it off.",
)


def _parse_packed_linear(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("auto", "all", "none"):
        raise ValueError("expected auto, all or none")
    return value


CPU_PACKED_LINEAR = EnvVar(
    "PDSERVE_CPU_PACKED_LINEAR",
    _parse_packed_linear,
    "auto",
    "CPU linear weights pre-packed for oneDNN: auto = bf16 only (same bits as F.linear, 1.3-2x "
    "faster); all = bf16 and fp32 (fp32 2-3x faster at batch >1, rounding ~2x F.linear's, so "
    "logprobs differ from transformers by ~1e-4); none = plain F.linear.",
)


def _parse_moe_experts(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("auto", "fused", "loop"):
        raise ValueError("expected auto, fused or loop")
    return value


MOE_EXPERTS = EnvVar(
    "PDSERVE_MOE_EXPERTS",
    _parse_moe_experts,
    "auto",
    "How a mixture-of-experts layer runs its experts: auto = the fused Triton grouped GEMMs "
    "on CUDA, the per-expert torch loop on CPU; fused = the Triton kernels everywhere (CPU "
    "only under TRITON_INTERPRET=1); loop = the per-expert torch loop (syncs with the host, "
    "so no CUDA graphs: the baseline the fused kernels are measured against).",
)


def _parse_nonneg_int(raw: str) -> int:
    value = int(raw.strip())
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


MOE_GEMV_MAX_TOKENS = EnvVar(
    "PDSERVE_MOE_GEMV_MAX_TOKENS",
    _parse_nonneg_int,
    0,
    "On the fused mixture-of-experts path, forwards of at most this many tokens (decode at "
    "small batch) take the few-token kernels: routing fused into the gate/up launch, no "
    "sort by expert; larger forwards take the grouped GEMMs. 0 = never. Unset: "
    "pdserve.model.moe_table.GEMV_MAX_TOKENS, the measured pick (1 on the H200 at "
    "Qwen3-30B-A3B's shapes since session 8: the layer at 1 token 31.8 -> 28.3 us).",
)


def _parse_moe_routing(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("model", "uniform"):
        raise ValueError(f"expected model or uniform, got {raw!r}")
    return value


MOE_ROUTING = EnvVar(
    "PDSERVE_MOE_ROUTING",
    _parse_moe_routing,
    "model",
    "Benchmarks only: `uniform` replaces every mixture-of-experts layer's router logits by a "
    "fixed random table (per layer, by the token's row in the forward; the router's GEMM still "
    "runs), so a decode batch routes its tokens spread over the experts as a trained router's "
    "load balancing does; random-weight presets otherwise send a batch to a few experts. "
    "Changes the model's outputs; `model` (default): the router's own choice. `bench "
    "offline --moe-routing` sets it.",
)


MOE_ROUTING_STATS = EnvVar(
    "PDSERVE_MOE_ROUTING_STATS",
    _parse_bool,
    False,
    "Count, in every mixture-of-experts layer and per forward size, the distinct experts each "
    "forward routes to, so `bench offline`'s roofline counts the bytes of the experts a decode "
    "step actually reads instead of all of them. Decode forwards count inside their routing "
    "kernels (the few-token gate/up at 1 token, route_align's alignment up to 64 tokens: no "
    "launch of their own); other forwards with a few small torch kernels per layer.",
)

# --- router ------------------------------------------------------------------------
ROUTER_ADMIN_TOKEN = EnvVar(
    "PDSERVE_ROUTER_ADMIN_TOKEN",
    str,
    "",
    "Bearer token of the router's admin API (/admin/workers), when --admin-token-file is not "
    "given; empty = the admin API is off. At least 16 characters.",
)

# --- tensor parallelism -----------------------------------------------------------
TP_TIMEOUT = EnvVar(
    "PDSERVE_TP_TIMEOUT",
    float,
    120.0,
    "Seconds a tensor-parallel collective (and the ranks' rendezvous) may wait for a peer "
    "before it fails; a rank that dies is noticed at once (its sentinel, the closed "
    "connection), this bounds a rank that hangs (read into ModelConfig.tp_timeout when the "
    "config is built; used by engine/worker/multiproc_executor.py).",
)


# --- HTTP servers ------------------------------------------------------------------
def _parse_positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"expected a whole number of seconds >= 1, got {raw!r}")
    return value


GRACEFUL_SHUTDOWN_S = EnvVar(
    "PDSERVE_GRACEFUL_SHUTDOWN_S",
    _parse_positive_int,
    5,
    "Seconds a stopped server (SIGTERM: a worker, a router) gives its in-flight requests "
    "before it cuts them with a 503; a router waits twice that for a worker its health "
    "checks ejected (read when pdserve.http.netutil is imported).",
)

# --- logging -----------------------------------------------------------------------
LOG_LEVEL = EnvVar(
    "PDSERVE_LOG_LEVEL",
    str,
    "INFO",
    "Log level of pdserve processes (DEBUG, INFO, WARNING, ERROR).",
)

# --- CPU threads (OpenMP's own variables; read by `pdserve up`) ---------------------
OMP_NUM_THREADS = EnvVar(
    "OMP_NUM_THREADS",
    int,
    0,
    "OpenMP/torch CPU threads per process; when set, `pdserve up` leaves its CPU workers' thread "
    "count to it instead of giving each os.cpu_count() // (CPU workers) threads (0 here = unset).",
)
OMP_WAIT_POLICY = EnvVar(
    "OMP_WAIT_POLICY",
    str,
    "",
    "OpenMP idle-thread policy; when unset, `pdserve up` sets PASSIVE for its children so "
    "co-located workers do not spin against each other.",
)


SUPERVISOR_PID = EnvVar(
    "PDSERVE_SUPERVISOR_PID",
    int,
    0,
    "Set by pdserve up in each child it starts (its own pid): the child stops (SIGTERM to "
    "itself) once that process is no longer its parent, e.g. after kill -9 of up; 0/unset: "
    "not watched.",
)


ALL: tuple[EnvVar, ...] = tuple(v for v in list(globals().values()) if isinstance(v, EnvVar))
