"""The decode side of the NIXL backend: its manager, one receiver per room, its prefill
peers (heartbeat, quarantine), the bootstrap lookups and the notification poller."""
