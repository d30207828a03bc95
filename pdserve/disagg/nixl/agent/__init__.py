"""What both sides of the NIXL backend share: the agent (``import nixl`` in :mod:`.api`
only), its creation, the transfer engine and descriptor lists, prefill's notifier
agent, UCX transport reports and remote-agent lifetime. Imports neither side."""
