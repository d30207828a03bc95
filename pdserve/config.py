"""Frozen, typed configuration for every pdserve process.

Each dataclass validates itself in ``__post_init__`` and raises ``ValueError`` naming the
field. CLI parsers read their defaults from these classes (``default_of``), so a default
is written once.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from pdserve import envs
from pdserve.bounds import CrossFieldError, check_min
from pdserve.disagg.base import Role, check_order
from pdserve.disagg.registry import backend_names
from pdserve.embedded import EMBEDDED_MODEL_ID
from pdserve.ports import check_port
from pdserve.tracing import traces_url

# The attention backends' names, so that ModelConfig checks a name without importing the
# model; ``model/attention.py``'s registry maps each to its class (a test keeps the two equal).
ATTENTION_BACKENDS = ("torch_sdpa", "triton")
# ``--quantization`` values (``model/fp8.py``'s QUANTIZATIONS; a test keeps the two equal) and
# ``--kv-cache-dtype`` values.
QUANTIZATIONS = ("fp8", "fp8_block")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def default_of(cls: type, name: str) -> Any:
    """Return the declared default of dataclass field ``name`` of ``cls``."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and how.

    model: HF folder, ``.gguf`` file, ``random:<preset>`` or the embedded id.
    dtype: ``auto`` (fp32 on CPU, bf16 on CUDA), ``float32``, ``bfloat16``, ``float16``.
    device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda``, ``cuda:N``.
    gpu_id: CUDA device index for this worker when ``device`` does not name one.
    max_model_len: context limit in tokens; ``None`` means the model's own.
    seed: seed of random weights (``random:`` models) and of sampling without a seed of its own.
    attention_backend: ``auto`` (``triton`` on CUDA, ``torch_sdpa`` on CPU) or a registered
        backend name (:data:`ATTENTION_BACKENDS`).
    enforce_eager: never capture CUDA graphs (every step runs eagerly).
    tensor_parallel_size: ranks the model is split over (``engine/worker/executor.py``): rank 0 in
        this process, ranks ``1..N-1`` processes it starts; 1 = no tensor parallelism.
    gpu_ids: CUDA device of each rank (``gpu_ids[r]`` for rank ``r``, one per rank);
        ``None`` = ``gpu_id + r`` (or the index of ``device`` ``cuda:N`` plus ``r``).
    quantization: ``None`` (the checkpoint as it is), ``fp8``: the decoder's linear
        weights quantized to e4m3 at load, one scale per output channel, or ``fp8_block``:
        one scale per output row and 128 input columns (``pdserve/model/fp8.py``). An FP8
        checkpoint loads as FP8 either way.
    tp_timeout: seconds a tensor-parallel collective (and the ranks' rendezvous) may wait
        for a peer; the default is ``PDSERVE_TP_TIMEOUT``, read when the config is built (the
        process edge), so the executor reads no environment.  Must be > 0.
    """

    model: str = EMBEDDED_MODEL_ID
    dtype: str = "auto"
    device: str = "auto"
    gpu_id: int = 0
    max_model_len: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    gpu_ids: tuple[int, ...] | None = None
    quantization: str | None = None
    tp_timeout: float = field(default_factory=envs.TP_TIMEOUT.get)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), "
                f"got {self.quantization!r}"
            )
        if self.attention_backend != "auto" and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be auto or one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not self.model:
            raise ValueError("model must be a non-empty string")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        check_min(self, 0, "gpu_id")
        check_min(self, 1, "max_model_len")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        check_min(self, 0, "tp_timeout", above=True, unit=" seconds")
        if self.gpu_ids is not None:
            ids = self.gpu_ids
            if not isinstance(ids, tuple):
                raise ValueError(f"gpu_ids must be a tuple of device indices, got {ids!r}")
            if len(ids) != self.tensor_parallel_size:
                raise CrossFieldError(
                    f"gpu_ids must name one device per rank ({self.tensor_parallel_size}), "
                    f"got {len(ids)}: {ids}"
                )
            if any(not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"gpu_ids must be distinct integers >= 0, got {ids}")

    def rank_gpu_id(self, rank: int) -> int:
        """CUDA device index of tensor-parallel rank ``rank`` (see ``gpu_ids``)."""
        if self.gpu_ids is not None:
            return self.gpu_ids[rank]
        base = int(self.device.split(":", 1)[1]) if self.device.startswith("cuda:") else self.gpu_id
        return base + rank


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool.

    page_size: tokens per page; ``None`` means the device's default
        (``pdserve.engine.kv.layout.default_page_size``: 16 on CPU, 128 on CUDA).
    kv_cache_memory: pool size in GiB; ``None`` means 1 GiB on CPU, or
        ``gpu_memory_utilization`` of free memory (after loading weights) on CUDA.  With a
        speculative draft model the budget holds its pool too (as many pages as the
        target's, the budget split by the two models' KV bytes per token).
    num_pages: exact page count (overrides ``kv_cache_memory``; used by tests).
    enable_prefix_caching: reuse the KV of full pages whose prefix was computed before
        (``pdserve.engine.kv.cache``); on decode workers, receive only what is not held.
    kv_order: physical order of the pool (``layer_major`` or ``page_major``, see
        ``pdserve.engine.kv.layout``); ``None`` means the device's default order.
    kv_cache_dtype: ``auto`` (the model's dtype) or ``fp8_e4m3``: K and V stored as e4m3
        with a per-tensor scale per layer (1.0, or the checkpoint's ``k_scale`` /
        ``v_scale``), half the bytes of bf16 per page and per transfer.
    """

    page_size: int | None = None
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.85
    num_pages: int | None = None
    enable_prefix_caching: bool = True
    kv_order: str | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        check_min(self, 1, "page_size")
        check_min(self, 0, "kv_cache_memory", above=True, unit=" GiB")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        check_min(self, 1, "num_pages")
        if self.kv_order is not None:
            check_order(self.kv_order)


SPECULATIVE_ALGORITHMS = (None, "ngram", "draft")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    max_running_requests: requests in the running batch at once (and the largest CUDA-graph
        batch); ``None`` means the device's default (:func:`default_max_running_requests`:
        256 on CUDA, 64 on CPU), resolved by the engine once its device is known.
    overlap_schedule: launch decode step N+1 from step N's sampled ids on the device before
        N's results are processed (``engine/core/overlap.py``); ``None`` = on for CUDA, off on
        CPU (a CPU forward is synchronous: nothing to overlap); ``True`` forces it on (the
        CPU tests do); ``False`` = off.  Speculative decoding turns it off.
    speculative_algorithm: ``None`` (off), ``"ngram"`` (prompt lookup, ``engine/spec/``) or
        ``"draft"`` (a draft model, ``speculative_model``).
    speculative_model: the draft model (as ``ModelConfig.model`` takes it), for ``draft``.
    num_speculative_tokens: drafts verified per row per step (k >= 1).
    speculative_ngram_min/speculative_ngram_max: n-gram sizes the ``ngram`` drafter
        matches, longest first.
    pd_compute_ahead_fraction: PD prefill: the share of the KV pool (in [0, 1]) that
        prompts computed before decode's destination arrived may take between them (each
        counted as its whole prompt's pages until the destination comes); beyond it a
        request waits for its destination before it is computed; 0 = every one waits.
    pd_compute_ahead_timeout_s: PD prefill: seconds a prompt computed before decode's
        destination arrived holds its pages waiting for it; then it gives them back (full
        pages stay in the prefix cache) and waits for the destination without pages, its
        prompt computed again when it comes; the request does not fail (the transfer
        backend's bootstrap timeout bounds the whole wait) (> 0).
    """

    max_num_batched_tokens: int = 2048
    max_running_requests: int | None = None
    overlap_schedule: bool | None = None
    speculative_algorithm: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 3
    pd_compute_ahead_fraction: float = 0.25
    pd_compute_ahead_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.pd_compute_ahead_fraction <= 1.0:
            raise ValueError(
                f"pd_compute_ahead_fraction must be in [0, 1], got {self.pd_compute_ahead_fraction}"
            )
        if not self.pd_compute_ahead_timeout_s > 0:
            raise ValueError(
                f"pd_compute_ahead_timeout_s must be > 0, got {self.pd_compute_ahead_timeout_s}"
            )
        check_min(self, 1, "max_num_batched_tokens", "max_running_requests")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                "speculative_algorithm must be ngram or draft (unset: off), "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculative_algorithm == "draft" and not self.speculative_model:
            raise CrossFieldError(
                "speculative_model must be set when speculative_algorithm is draft"
            )
        check_min(self, 1, "num_speculative_tokens", "speculative_ngram_min")
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise CrossFieldError(
                f"speculative_ngram_max ({self.speculative_ngram_max}) must be >= "
                f"speculative_ngram_min ({self.speculative_ngram_min})"
            )

    def speculative_key(self) -> str:
        """The speculative configuration as one string peers compare at the PD bootstrap
        (``KVLayout.speculative``): ``""`` when off, else e.g. ``"ngram k=4 n=1-3"`` or
        ``"draft k=4 model=<id>"``."""
        algo = self.speculative_algorithm
        if algo is None:
            return ""
        k = self.num_speculative_tokens
        if algo == "ngram":
            return f"ngram k={k} n={self.speculative_ngram_min}-{self.speculative_ngram_max}"
        return f"draft k={k} model={self.speculative_model}"

    def speculative_info(self) -> dict[str, object] | None:
        """The speculative configuration as plain data (``/get_server_info``, the PD
        handshake), or ``None`` when speculation is off."""
        if self.speculative_algorithm is None:
            return None
        info: dict[str, object] = {
            "speculative_algorithm": self.speculative_algorithm,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.speculative_algorithm == "ngram":
            info["speculative_ngram_min"] = self.speculative_ngram_min
            info["speculative_ngram_max"] = self.speculative_ngram_max
        else:
            info["speculative_model"] = self.speculative_model
        return info

    @property
    def max_running(self) -> int:
        """``max_running_requests`` once resolved (the engine resolves an unset one from its
        device); ValueError naming it while unset."""
        if self.max_running_requests is None:
            raise ValueError("max_running_requests is unset: the engine resolves it first")
        return self.max_running_requests


def default_max_running_requests(device_type: str) -> int:
    """``SchedulerConfig.max_running_requests`` when unset: 256 on ``"cuda"`` (a decode step
    of an 8B model is still memory-bound at 128 rows and near its compute roofline at 256:
    docs/benchmarks.md), 64 elsewhere."""
    return 256 if device_type == "cuda" else 64


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation of one worker.

    role: ``mixed`` (no disaggregation), ``prefill`` or ``decode`` (a string is parsed
        into :class:`~pdserve.disagg.base.Role`).
    transfer_backend: registry name of the KV transfer backend
        (:func:`pdserve.disagg.registry.backend_names`: ``nixl`` or ``fake``).
    bootstrap_host: address the prefill bootstrap server and ZMQ control endpoint listen
        on (``0.0.0.0`` / ``::``: every interface, an explicit choice).
    bootstrap_port: HTTP port of the prefill bootstrap server (0 = pick a free one).
    advertise_host: address (IP or DNS name) decode peers and the router use to reach this
        prefill's bootstrap server and control endpoint; ``None`` = ``bootstrap_host``, or
        for a wildcard this host's address on the network (:mod:`pdserve.advertise`).
    """

    role: Role = Role.MIXED
    transfer_backend: str = "nixl"
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        if self.role not in tuple(Role):
            raise ValueError(f"role must be mixed, prefill or decode, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))  # parsed at the edge
        if self.transfer_backend not in backend_names():
            raise ValueError(
                f"transfer_backend must be {' or '.join(backend_names())}, "
                f"got {self.transfer_backend!r}"
            )
        check_port(self.bootstrap_port, "bootstrap_port", allow_zero=True)
        if not self.bootstrap_host:
            raise ValueError("bootstrap_host must be a non-empty address (0.0.0.0 = all)")
        if self.advertise_host is not None and self.advertise_host in ("", "0.0.0.0", "::"):
            raise ValueError(
                f"advertise_host must be an address peers can reach, got {self.advertise_host!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one worker, or the offline ``LLM``) needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_fields(cls, **values: Any) -> EngineConfig:
        """An EngineConfig from flat field names (``model=..., page_size=...,
        max_running_requests=...``): each value goes to the one of ModelConfig,
        CacheConfig, SchedulerConfig that declares the field (no name is in two); the
        rest keep their defaults.  How ``LLM(...)`` and the engine flags
        (``server.engine_args``) build theirs.  TypeError naming a field none declares;
        the sub-configs' ValueError naming a bad value."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owner = {
            f.name: part
            for part, sub in (
                ("model", ModelConfig),
                ("cache", CacheConfig),
                ("scheduler", SchedulerConfig),
            )
            for f in fields(sub)
        }
        for name, value in values.items():
            if name not in owner:
                raise TypeError(f"EngineConfig has no field {name!r} in any of its parts")
            parts[owner[name]][name] = value
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front of one worker (``pdserve serve``).

    host/port: where the worker listens (port 0 = pick a free one and print it).
    served_model_name: the model name of the OpenAI API; ``None`` means the ``--model`` value.
    health_generate_timeout: seconds ``/health_generate`` waits for its one-token generation.
    idle_poll_interval: seconds the engine thread sleeps between steps that made no progress
        (e.g. while KV transfers are pending), so it keeps polling without spinning; a KV
        room's state change ends the sleep at once (``KVManager.set_wakeup``).
    num_threads: torch intra-op CPU threads of the worker (``torch.set_num_threads``, set
        before the model loads); 0 = torch's default (``OMP_NUM_THREADS`` or all cores).
    max_request_body_bytes: largest request body accepted, in bytes (413 above).
    request_read_timeout: seconds a request's line and headers may take to arrive, and
        its body may pause between two reads; 408 and the connection closed after
        (``http/read_timeout.py``; 60 s: nginx's client_header/body_timeout).
    strict_request_fields: answer 400 for an unknown request field instead of ignoring it
        with a warning (``server/field_policy.py``).
    otlp_traces_endpoint: OTLP/HTTP collector URL the worker sends its traces to
        (``pdserve/tracing.py``); ``None`` = tracing off.
    responses_store_size: most responses of ``/v1/responses`` kept in memory for
        ``GET /v1/responses/{id}`` and ``previous_response_id`` (the oldest dropped first);
        0 keeps none.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    health_generate_timeout: float = 30.0
    idle_poll_interval: float = 0.002
    num_threads: int = 0
    max_request_body_bytes: int = 32 * 2**20
    request_read_timeout: float = 60.0  # http/read_timeout.py DEFAULT_REQUEST_READ_TIMEOUT_S
    strict_request_fields: bool = False
    otlp_traces_endpoint: str | None = None
    responses_store_size: int = 1000

    def __post_init__(self) -> None:
        if self.otlp_traces_endpoint is not None:
            traces_url(self.otlp_traces_endpoint)
        check_min(self, 0, "responses_store_size")
        if not self.host:
            raise ValueError("host must be a non-empty string")
        check_port(self.port, "port", allow_zero=True)
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must be non-empty when given")
        check_min(self, 0, "health_generate_timeout", above=True, unit=" s")
        if not 0 < self.idle_poll_interval <= 1:
            raise ValueError(
                f"idle_poll_interval must be in (0, 1] s, got {self.idle_poll_interval}"
            )
        if self.num_threads < 0:
            raise ValueError(
                f"num_threads must be >= 0 (0 = torch's default), got {self.num_threads}"
            )
        check_min(self, 0, "max_request_body_bytes", above=True)
        check_min(self, 0, "request_read_timeout", above=True, unit=" s")


ROUTER_POLICIES = ("random", "round_robin", "power_of_two", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    """The router (``pdserve router``).

    PD mode: ``prefill_urls`` and ``decode_urls`` both non-empty; regular mode:
    ``worker_urls`` non-empty (mixed workers). The two modes are exclusive.
    mode: ``auto`` (PD when prefill/decode URLs are given, else regular), ``pd`` or
        ``regular``; an explicit mode may start with no workers when the admin API is on.
    admin_token: bearer token of the admin API (``/admin/workers``: add, remove, list
        workers at run time); ``None`` = the admin API is off.
    policy: ``random``, ``round_robin``, ``power_of_two`` (fewest outstanding requests of
        two random picks) or ``cache_aware`` (the worker that was sent the longest prefix
        of the prompt, unless the load is out of balance; ``router/workers.py``).
    request_timeout: seconds one client request may take end to end (504 after).
    health_check_interval/timeout: seconds between probes of each worker's ``/health`` and
        how long one probe may take; ``health_failure_threshold`` consecutive failures eject
        a worker, one success restores it.
    max_request_body_bytes: largest request body accepted, in bytes (413 above).
    request_read_timeout: seconds a request's line and headers may take to arrive, and
        its body may pause between two reads; 408 and the connection closed after
        (``http/read_timeout.py``).
    otlp_traces_endpoint: OTLP/HTTP collector URL the router sends its traces to
        (``pdserve/tracing.py``); ``None`` = tracing off.
    max_migrations: times one request may move to another worker (pair) after its worker
        failed (a stream continued from the tokens sent, a request sent again whole);
        0 = never (``router/migration.py``).
    migration_wait: seconds such a request waits for a healthy worker (pair) to move to
        when there is none (all of a role died; ``pdserve up`` restarts them) before it
        ends with its failure.
    pd_min_prefill_tokens: selective PD: a request whose uncached prompt part (its
        estimated length less the share a decode worker holds by the router's prefix
        index) is below this many tokens runs whole on that decode worker, skipping the
        prefill leg and the KV transfer; 0 = always PD (``Picker.pick_now`` in
        ``router/picking.py``). The default, 64, is measured (docs/benchmarks.md row X):
        16-token prompts' TTFT p50 through PD / decode alone 1.10-1.13 on CPU (two runs),
        ~1,000-token prompts still disaggregated.
    """

    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "power_of_two"
    request_timeout: float = 600.0
    health_check_interval: float = 2.0
    health_check_timeout: float = 5.0
    health_failure_threshold: int = 2
    max_request_body_bytes: int = 32 * 2**20
    request_read_timeout: float = 60.0  # http/read_timeout.py DEFAULT_REQUEST_READ_TIMEOUT_S
    mode: str = "auto"
    admin_token: str | None = None
    otlp_traces_endpoint: str | None = None
    max_migrations: int = 2
    migration_wait: float = 30.0
    pd_min_prefill_tokens: int = 64

    def __post_init__(self) -> None:
        if self.otlp_traces_endpoint is not None:
            traces_url(self.otlp_traces_endpoint)
        check_min(self, 0, "max_migrations")
        check_min(self, 0, "migration_wait", unit=" s")
        check_min(self, 0, "pd_min_prefill_tokens")
        if self.mode not in ("auto", "pd", "regular"):
            raise ValueError(f"mode must be auto, pd or regular, got {self.mode!r}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("admin_token must be at least 16 characters")
        pd = bool(self.prefill_urls) or bool(self.decode_urls)
        if pd and self.worker_urls:
            raise ValueError(
                "worker_urls (regular mode) cannot be combined with prefill_urls/decode_urls (PD mode)"
            )
        if self.mode == "regular" and pd:
            raise ValueError("mode regular takes worker_urls, not prefill_urls/decode_urls")
        if self.mode == "pd" and self.worker_urls:
            raise ValueError("mode pd takes prefill_urls and decode_urls, not worker_urls")
        # An explicit mode with the admin API on may start empty: workers are added later.
        may_start_empty = self.mode != "auto" and self.admin_token is not None
        if pd and not (self.prefill_urls and self.decode_urls) and not may_start_empty:
            missing = "decode_urls" if self.prefill_urls else "prefill_urls"
            raise ValueError(
                f"{missing} must be non-empty in PD mode (give at least one of each role)"
            )
        if not pd and not self.worker_urls and not may_start_empty:
            raise ValueError(
                "worker_urls must be non-empty (or give prefill_urls and decode_urls, or an "
                "explicit mode with the admin API on to add workers later)"
            )
        for name in ("prefill_urls", "decode_urls", "worker_urls"):
            for url in getattr(self, name):
                if not (url.startswith("http://") or url.startswith("https://")):
                    raise ValueError(f"{name}: {url!r} must start with http:// or https://")
        check_port(self.port, "port", allow_zero=True)
        check_min(self, 0, "max_request_body_bytes", above=True)
        check_min(self, 0, "request_read_timeout", above=True, unit=" s")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}"
            )
        check_min(
            self,
            0,
            "request_timeout",
            "health_check_interval",
            "health_check_timeout",
            above=True,
            unit=" s",
        )
        check_min(self, 1, "health_failure_threshold")

    @property
    def pd_mode(self) -> bool:
        """True when the router pairs prefill and decode workers."""
        return self.mode == "pd" or bool(self.prefill_urls) or bool(self.decode_urls)
