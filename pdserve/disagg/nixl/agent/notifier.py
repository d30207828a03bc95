"""Prefill's second NIXL agent, which only sends notifications (``XferDone``).

Why a second agent: with UCX, a notification is an active message on the endpoint's TCP
lane, which flags that UCT endpoint (``NEED_FLUSH``); the flush that ends the next WRITE
on it then sends an empty PUT and waits for the peer's acknowledgement, i.e. for decode's
worker to progress (``uct_tcp_ep_flush``). Sent on the WRITEs' own endpoint, every room's
notification so cost the next room's WRITE a round trip on decode's polling cadence
(several times the WRITE itself: docs/benchmarks.md, "Notes moved from disagg
docstrings"). This agent has no memory registered and
posts no WRITE, so nothing of it is ever flushed; the WRITEs' agent sends no active message
at all. Decode needs nothing of it: it reads notifications of any agent
(``get_new_notifs``), and UCX wires the endpoint up from its side.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from pdserve.disagg.base import KVArgs, Role
from pdserve.disagg.nixl.agent.api import NixlApi
from pdserve.disagg.nixl.agent.init import as_str, create_agent
from pdserve.disagg.transfer_config import THREAD_PARAM, NixlInitSpec


class NixlNotifier:
    """A NIXL agent (the backend of ``spec``, no worker threads) that sends notifications
    to the decode agents loaded into it. Thread-safe (the agent is created
    ``NIXL_THREAD_SYNC_STRICT``). Raises at creation whatever :func:`create_agent` raises.

    name: the agent's name (unique per process); spec: the WRITE agent's init spec.
    """

    def __init__(self, api: NixlApi, name: str, kv_args: KVArgs, spec: NixlInitSpec) -> None:
        thread_key = THREAD_PARAM.get(spec.backend)
        params = {k: v for k, v in spec.params.items() if k != thread_key}
        self.agent = create_agent(
            api, name, kv_args, Role.PREFILL, replace(spec, params=params, num_threads=0)
        )
        self._lock = threading.Lock()
        self._remotes: set[str] = set()

    def add_remote(self, metadata: bytes) -> str:
        """Load a decode agent's metadata and open the connection; returns its name."""
        name = as_str(self.agent.add_remote_agent(metadata))
        self.agent.make_connection(name)
        with self._lock:
            self._remotes.add(name)
        return name

    def remove_remote(self, agent_name: str) -> None:
        """Forget a decode agent (a no-op for one never loaded)."""
        with self._lock:
            if agent_name not in self._remotes:
                return
            self._remotes.discard(agent_name)
        self.agent.remove_remote_agent(agent_name)

    def num_remotes(self) -> int:
        with self._lock:
            return len(self._remotes)

    def send_notif(self, agent_name: str, payload: bytes) -> None:
        """Send ``payload`` to a loaded decode agent (NIXL's ``send_notif``; raises NIXL's
        error when it cannot)."""
        self.agent.send_notif(agent_name, payload)

    def progress(self) -> None:
        """Progress the agent's worker (connection wire-up, completions of sends)."""
        self.agent.get_new_notifs()
