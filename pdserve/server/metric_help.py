"""What each scrape-time stat of a worker means: the HELP text (with its unit) and the
Prometheus type of every key of ``EngineCore.stats()`` (``pdserve_engine_*``) and of the KV
managers' ``stats()`` (``pdserve_kv_transfer_*``, ``disagg/metrics.py`` and the NIXL / fake
managers), ``GcWatch.stats()`` (``pdserve_gc_*``) and ``CompileWatch.stats()`` (``pdserve_triton_*``). Keys are the stats dict's keys (nested: joined by ``_``); a key missing here is
exported with its name as its help (tests/server/test_server_metrics.py checks that every
key the engine and the managers report is here)."""

from __future__ import annotations

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

# key -> (help, type). Counters are monotonic since the worker started (every "cumulative"
# count here: tests/server/test_metric_counters.py checks that); CounterMetricFamily names
# their sample ``<name>_total`` (the family keeps ``<name>``), as Prometheus' convention.
HELP: dict[str, tuple[str, str]] = {
    # --- engine (EngineCore.stats, KVCacheManager.stats) ----------------------------------
    "num_running": ("requests in the running batch", GAUGE),
    "num_waiting": ("requests queued for their first prefill step", GAUGE),
    "num_waiting_for_peer": (
        "requests waiting for their disaggregation peer before their KV transfer",
        GAUGE,
    ),
    "num_transferring": ("requests whose KV cache is being transferred", GAUGE),
    "num_draining": (
        "finished requests whose KV pages stay held until their transfer ends",
        GAUGE,
    ),
    "num_quarantined_pages": (
        "KV pages held back after a failed or unconfirmed transfer (pages)",
        GAUGE,
    ),
    "pd_ahead_pages": (
        "PD prefill: KV pages counted against --pd-compute-ahead-fraction, the whole "
        "prompts of requests computed before decode's destination arrived (pages)",
        GAUGE,
    ),
    "pd_ahead_capped": (
        "PD prefill: requests that waited for decode's destination before being computed, "
        "the compute-ahead share being full, since start (cumulative count)",
        COUNTER,
    ),
    "pd_ahead_expired": (
        "PD prefill: prompts computed before decode's destination arrived that waited "
        "--pd-compute-ahead-timeout for it and gave their KV pages back (computed again "
        "when it comes), since start (cumulative count)",
        COUNTER,
    ),
    "num_free_pages": ("KV cache pages available to new requests (pages)", GAUGE),
    "num_total_pages": ("KV cache pages of the pool (pages)", GAUGE),
    "num_preemptions": (
        "requests preempted for lack of KV pages since start (cumulative count)",
        COUNTER,
    ),
    "prompt_tokens_computed": (
        "prompt tokens run through prefill since start, prefix-cache hits excluded "
        "(cumulative tokens)",
        COUNTER,
    ),
    "steps": ("engine steps run since start (cumulative count)", COUNTER),
    "generation_tokens": ("output tokens sampled since start (cumulative tokens)", COUNTER),
    "spec_draft_tokens": (
        "speculative decoding: draft tokens verified since start (cumulative tokens)",
        COUNTER,
    ),
    "spec_accepted_tokens": (
        "speculative decoding: draft tokens accepted since start (cumulative tokens)",
        COUNTER,
    ),
    "spec_verify_rows": (
        "speculative decoding: verify rows (a sequence's last token + its drafts) run since "
        "start (cumulative rows)",
        COUNTER,
    ),
    "spec_acceptance_length": (
        "speculative decoding: tokens each verify row kept (accepted drafts + 1; tokens)",
        HISTOGRAM,
    ),
    "finished_requests": ("requests finished since start (cumulative count)", COUNTER),
    "overlap_launched_steps": (
        "steps launched without waiting for the host since start (cumulative count)",
        COUNTER,
    ),
    "overlap_ahead_steps": (
        "of the overlap-launched steps, those launched before the previous step's "
        "results were read (cumulative count)",
        COUNTER,
    ),
    "prefix_cache_query_tokens": (
        "prompt tokens looked up in the prefix cache since start (cumulative tokens)",
        COUNTER,
    ),
    "prefix_cache_hit_tokens": (
        "prompt tokens found in the prefix cache since start (cumulative tokens)",
        COUNTER,
    ),
    "prefix_cache_evicted_pages": (
        "prefix-cache pages evicted to make room since start (cumulative pages)",
        COUNTER,
    ),
    "num_cached_pages": ("KV pages held only by the prefix cache, evictable (pages)", GAUGE),
    "num_held_pages": ("KV pages held by live requests or draining rooms (pages)", GAUGE),
    # --- KV transfer (KVManager.stats) ------------------------------------------------------
    "bytes_transferred": ("KV cache bytes moved by finished transfers (cumulative bytes)", COUNTER),
    "pages_transferred": ("KV cache pages moved by finished transfers (cumulative pages)", COUNTER),
    "transfers_succeeded": ("rooms whose KV transfer succeeded (cumulative count)", COUNTER),
    "transfer_latency_seconds": (
        "one room's KV transfer, prefill: send to WRITEs done; decode: destination sent "
        "to completion notification (seconds)",
        HISTOGRAM,
    ),
    "completion_latency_seconds": (
        "prefill: a room's last send to every WRITE done and decode notified (seconds)",
        HISTOGRAM,
    ),
    "transfers_failed": ("rooms whose KV transfer failed, by reason", COUNTER),
    "rooms": ("bootstrap rooms of this manager by state", GAUGE),
    "live_rooms": ("bootstrap rooms alive on this manager", GAUGE),
    "healthy": ("1 while every thread of the KV manager runs, else 0", GAUGE),
    "decode_peers": ("prefill: decode workers known to this manager", GAUGE),
    "remote_agents": ("NIXL remote agents loaded (peers)", GAUGE),
    "notifier_remote_agents": ("prefill: remote agents of the notification agent", GAUGE),
    "prepared_dlists": ("NIXL prepared descriptor lists alive", GAUGE),
    "premade_writes": ("prefill: premade NIXL WRITE handles not yet released", GAUGE),
    "premade_writes_made": ("prefill: premade NIXL WRITE handles made (cumulative count)", COUNTER),
    "premade_writes_posted": (
        "prefill: premade NIXL WRITE handles posted (cumulative count)",
        COUNTER,
    ),
    "notifs_sent": ("prefill: XferDone notifications handed to NIXL (cumulative count)", COUNTER),
    "early_dests": (
        "prefill: decode destinations waiting for their room to be created (one per decode rank)",
        GAUGE,
    ),
    "notifs_received": ("decode: NIXL notifications read (cumulative count)", COUNTER),
    "notifs_unmatched": (
        "decode: notifications that matched no live room of their prefill (cumulative count)",
        COUNTER,
    ),
    "notifs_read_age_s": ("decode: since the notification thread last read NIXL (seconds)", GAUGE),
    "prefill_peers": ("decode: prefill workers known to this manager", GAUGE),
    "suspect_prefill_peers": ("decode: prefill workers suspected gone", GAUGE),
    "quarantined_rooms": ("decode: rooms whose KV pages are quarantined", GAUGE),
    "quarantined_pages": ("decode: KV pages quarantined by those rooms (pages)", GAUGE),
    "unhealthy_prefill_peers": (
        "decode: age of the oldest quarantine per prefill peer, past the bound (seconds)",
        GAUGE,
    ),
    # --- garbage collection (gc_watch.GcWatch.stats: pdserve_gc_*) -------------------------
    "frozen_objects": ("objects moved to the permanent generation after start-up", GAUGE),
    "startup_full_collection_seconds": (
        "the full collection before the freeze: what one would cost without it (seconds)",
        GAUGE,
    ),
    "collections": ("garbage collections by generation since start (cumulative count)", COUNTER),
    "pause_seconds": ("how long each garbage collection stopped the process (seconds)", HISTOGRAM),
    "max_pause_seconds": ("the longest garbage-collection pause since start (seconds)", GAUGE),
    # --- Triton compilations (triton_watch.CompileWatch.stats: pdserve_triton_*) ----------
    "compilations_at_startup": ("Triton kernel variants compiled during start-up", GAUGE),
    "compilations_after_startup": (
        "Triton kernel variants compiled while serving: each one stalled a step (cumulative)",
        COUNTER,
    ),
    "compilations_after_startup_by_kernel": (
        "Triton kernel variants compiled while serving, by kernel (cumulative)",
        COUNTER,
    ),
}

# exported by another family: the sum over reasons of pdserve_kv_transfer_transfers_failed_total
SKIPPED = frozenset({"transfers_failed_total"})
