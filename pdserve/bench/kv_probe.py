"""KV bytes moved between prefill and decode workers, read from their ``/metrics``.

A PD router lists its workers in ``/get_server_info``; each prefill worker exports the
bytes it sent as ``pdserve_kv_transfer_bytes_transferred`` (``disagg/metrics.py``).  The
benchmark reads the sum before and after a block of requests; the difference over the
requests completed is the KV bytes transferred per request.  A target that is not a PD
router (a mixed worker, another server) gives ``None``: nothing to count.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.disagg.base import Role

BYTES_METRIC = "pdserve_kv_transfer_bytes_transferred"


async def prefill_urls(client: httpx.AsyncClient, base_url: str) -> list[str] | None:
    """URLs of the prefill workers behind the router at ``base_url``; ``None`` when it is
    not a pdserve PD router (no such info, or no prefill worker)."""
    try:
        resp = await client.get(f"{base_url}/get_server_info")
        info = resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return None
    workers = info.get("workers") if isinstance(info, dict) else None
    if not isinstance(workers, list):
        return None
    urls = [w["url"] for w in workers if isinstance(w, dict) and w.get("role") == Role.PREFILL]
    return urls or None


async def kv_bytes_sent(client: httpx.AsyncClient, urls: list[str] | None) -> int | None:
    """Sum of the KV bytes the prefill workers at ``urls`` sent so far; ``None`` when
    ``urls`` is ``None`` or a worker's metrics cannot be read."""
    if urls is None:
        return None
    total = 0
    for url in urls:
        try:
            resp = await client.get(f"{url}/metrics")
            resp.raise_for_status()
        except httpx.HTTPError:
            return None
        for family in text_string_to_metric_families(resp.text):
            if family.name == BYTES_METRIC:
                total += int(sum(s.value for s in family.samples))
    return total
