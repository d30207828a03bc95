"""The end of a peer's life on this side's NIXL agents, the same for both roles: a peer
known gone (its process ended, or it restarted as a new instance) is forgotten, so
restarts leave remote agents flat. Who decides that a peer is gone differs by role:
decode's heartbeat (:class:`~pdserve.disagg.nixl.decode.receiver.PrefillPeers`: ``GET /health`` of each
prefill, suspects kept while they may still WRITE) and prefill's ``Ping`` on its ROUTER
(:class:`~pdserve.disagg.nixl.prefill.manager.DecodePeers`: a decode it can no longer route to).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.disagg.nixl.agent.transfer_engine import (
        NixlNotifier,
        NixlTransferEngine,
        RemoteSide,
    )

log = logging.getLogger(__name__)


def forget_agent(
    engine: NixlTransferEngine,
    agent_name: str,
    what: str,
    remote: RemoteSide | None = None,
    notifier: NixlNotifier | None = None,
) -> None:
    """Forget the gone peer ``what`` (its name in the log) whose agent ``agent_name`` is
    loaded into ``engine``: release ``remote``'s prepared descriptor lists (prefill), then
    remove the agent (NIXL ``remove_remote_agent``) from ``engine`` and from ``notifier``
    (prefill's second agent). Best effort: a failure is logged, never raised (the worker
    keeps serving)."""
    try:
        if remote is not None:
            engine.release_remote(remote)
        engine.remove_remote(agent_name)
        if notifier is not None:
            notifier.remove_remote(agent_name)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.warning("forgetting %s: %s", what, exc)
